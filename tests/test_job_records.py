"""What a job keeps of each attempt: its environment (``jobs/env_record.py``: owner-only,
secrets' values hidden) and, under Slurm, one log that every requeue appends to and a
launch that ends when a rank dies."""

import os
import stat

import pytest

from hpctrain.cli import main
from hpctrain.jobs.env_record import HIDDEN, environment_text, main as env_record_main


def test_secret_looking_names_keep_only_that_they_are_set():
    text = environment_text({"WANDB_API_KEY": "abc", "HF_TOKEN": "hf_x", "aws_secret": "s",
                             "DB_PASSWORD": "p", "PATH": "/bin", "SLURM_JOB_ID": "7"})
    assert text.splitlines() == ["DB_PASSWORD=<set>", "HF_TOKEN=<set>", "PATH=/bin",
                                 "SLURM_JOB_ID=7", "WANDB_API_KEY=<set>", "aws_secret=<set>"]
    assert "abc" not in text and "hf_x" not in text and HIDDEN in text


def test_a_value_over_several_lines_stays_on_its_own_line():
    text = environment_text({"A": "one\ntwo", "B_KEY": "-----BEGIN\nsecret\n-----END"})
    assert text == "A=one\\ntwo\nB_KEY=<set>\n"


def test_the_record_is_owner_only_whatever_the_umask_and_never_replaces(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("HPCTRAIN_TEST_TOKEN", "do-not-leak")
    path = tmp_path / "env.txt"
    old = os.umask(0)
    try:
        assert env_record_main([str(path)]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert "HPCTRAIN_TEST_TOKEN=<set>" in text and "do-not-leak" not in text
    assert env_record_main([str(path)]) == 1  # an attempt's record is written once
    assert path.read_text() == text


@pytest.mark.parametrize("system", ["slurm", "perlmutter", "frontier"])
def test_slurm_scripts_append_to_their_log_and_end_a_step_whose_rank_died(tmp_path, system):
    """Without --open-mode=append a requeued job truncates its output file: the first
    attempt's stop message would be gone. Without --kill-on-bad-exit a rank that dies
    leaves the others waiting in a collective for the whole --comm.timeout."""
    out = tmp_path / "job.sh"
    assert main(["jobscript", "--system", system, "--nodes", "1", "--walltime", "00:10:00",
                 "--account", "A", "--queue", "debug", "--output", str(out), "--", "train",
                 "default"]) == 0
    text = out.read_text()
    assert "#SBATCH --open-mode=append" in text
    srun = next(line for line in text.splitlines() if line.lstrip().startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun  # a dead rank ends the step, not the timeout
    assert "-m hpctrain.jobs.env_record" in text and "env | sort" not in text
