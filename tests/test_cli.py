"""The command line end to end, in subprocesses under real mpiexec with time limits."""

import json
import sys

import pytest

from tests.helpers import hpctrain_cmd, mpiexec, run

pytestmark = pytest.mark.slow

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--train.batch_size=8", "--train.max_iters=30", "--train.log_interval=10",
        "--train.eval_interval=15", "--train.eval_iters=2", "--train.sample_tokens=30",
        "--train.progress=false"]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def test_bad_option_gives_one_message_and_exit_2():
    p = run(hpctrain_cmd("train", "default", "--train.max_iter=5"))
    assert p.returncode == 2
    assert _errors(p.stderr) == ["error: unknown option --train.max_iter; did you mean "
                                 "--train.max_iters?"]
    assert "Traceback" not in p.stderr


def test_bad_option_under_mpiexec_is_reported_once():
    p = run(mpiexec(2, *hpctrain_cmd("train", "default", "--model.n_head=3")))
    assert p.returncode != 0
    assert len(_errors(p.stderr)) == 1 and "multiple of model.n_head" in p.stderr


def test_world_size_error_after_mpi_start_is_reported_once(dataset_path, tmp_path):
    p = run(mpiexec(4, *hpctrain_cmd("train", "default", f"--data.path={dataset_path}",
                                     f"--train.out_dir={tmp_path}", "--train.batch_size=6")))
    assert p.returncode != 0
    errors = _errors(p.stderr)
    assert len(errors) == 1 and "use a multiple of 4" in errors[0], p.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_missing_data_names_the_prepare_command(tmp_path):
    p = run(hpctrain_cmd("train", "default", f"--data.path={tmp_path}/none.h5",
                         f"--train.out_dir={tmp_path}/out"))
    assert p.returncode == 2
    assert "does not exist; create it with `hpctrain prepare" in p.stderr


def test_exception_on_one_rank_aborts_the_job_quickly(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "from hpctrain.comm.abort import install_abort_handler\n"
        "install_abort_handler(MPI.COMM_WORLD)\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise RuntimeError('boom on rank 1')\n"
        "MPI.COMM_WORLD.Barrier()  # without the handler, rank 0 would wait here forever\n")
    # Without the handler rank 0 waits forever: run()'s limit fails the test then.
    p = run(mpiexec(2, sys.executable, str(script)), timeout=60)
    assert p.returncode != 0
    assert "[rank 1/2] Traceback" in p.stderr and "RuntimeError: boom on rank 1" in p.stderr


def test_prepare_train_sample_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 300)
    data, out = tmp_path / "d.h5", tmp_path / "run"
    p = run(hpctrain_cmd("prepare", "--input", str(corpus), "--output", str(data)))
    assert p.returncode == 0 and "prepared" in p.stdout, p.stderr
    p = run(mpiexec(2, *hpctrain_cmd("train", "default", f"--data.path={data}",
                                     f"--train.out_dir={out}", *TINY)), timeout=180)
    assert p.returncode == 0, p.stderr
    assert "2 rank(s)" in p.stdout and "final validation loss" in p.stdout
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [10, 15, 20, 30]
    assert records[-1]["final_val_loss"] < records[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30
    p = run(hpctrain_cmd("sample", "--checkpoint", str(out), "--prompt", "the ", "--tokens", "40"))
    assert p.returncode == 0 and p.stdout.startswith("the ") and len(p.stdout) > 40, p.stderr
    p = run(hpctrain_cmd("sample", "--checkpoint", str(out), "--prompt", "Zebra"))
    assert p.returncode == 2 and "not in the" in p.stderr


def test_version_and_module_entry_point():
    p = run(hpctrain_cmd("--version"))
    assert p.returncode == 0 and p.stdout.startswith("hpctrain ")


@pytest.mark.parametrize("command", [["jobscript", "--help"], ["plan", "--help"], ["--help"]])
def test_help_starts_without_torch_or_mpi4py(command):
    # Login nodes run jobscript and plan: their start must not pay for torch or mpi4py
    # (each handler imports what it needs). -X importtime names every module imported.
    p = run([sys.executable, "-X", "importtime", "-m", "hpctrain", *command])
    assert p.returncode == 0 and p.stdout.startswith("usage: hpctrain"), p.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hpctrain.cli.dispatch" in imported  # the trace is there to read
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "mpi4py"))
    assert heavy == [], f"hpctrain {' '.join(command)} imported {heavy[:5]}"
