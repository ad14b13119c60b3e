"""Jobs that continue and say how they ended (issue 29, items 1 and 5), without MPI:
the run directory named by the job, ``--train.resume=auto``, a folder of records per
attempt, the exit status of an early stop, the job's end asked of the scheduler, the
warning for a long signal lead. Scripts run end to end in tests/test_jobs_e2e.py (fake
PBS and Slurm) and tests/test_slurm_real.py (a real Slurm)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime

import pytest

from hpctrain.cli import main
from hpctrain.errors import JobError
from hpctrain.jobs import job_end
from hpctrain.jobs.attempts import attempts, latest_attempt
from hpctrain.jobs.validate import signal_lead
from hpctrain.train.deadline import JOB_END_ENV, JOB_START_ENV, Deadline
from hpctrain.train.run_status import main as status_main
from hpctrain.train.run_status import read_status, shell_line, status_record, write_status
from tests.helpers import hpctrain_cmd, launcher, mpiexec, run
from tests.jobs_common import CMD, directives, launch_block, script


def _run_dir_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("RUN_DIR="))


# ---------------------------------------------------------------- the run directory

def test_a_training_job_resumes_in_a_run_directory_named_by_the_job_not_its_id():
    text = script("slurm")
    assert _run_dir_line(text) == 'RUN_DIR="${RUN_ROOT}"/hpctrain'
    words = launch_block(text)
    assert words[-2:] == ["--train.resume=auto", "--train.out_dir=${RUN_DIR}"]
    assert "JOB_TAG" not in _run_dir_line(text)
    # Each attempt's records in jobs/<job id>/ (jobs/<job id>.2/ for a requeue).
    assert 'ATTEMPT_DIR=$RUN_DIR/jobs/$JOB_TAG' in text
    for record in ("jobscript.sh", "env.txt", "git.txt", "job.txt", "launch.txt",
                   "exit_code"):
        assert f'"$ATTEMPT_DIR/{record}"' in text, record
    assert '"$RUN_DIR/exit_code"' not in text


def test_arrays_get_a_run_directory_per_index_and_the_users_resume_wins():
    arr = script("polaris", command=CMD + ["--train.seed={array_index}"], array="0-3%1")
    assert _run_dir_line(arr) == 'RUN_DIR="${RUN_ROOT}"/hpctrain-"${ARRAY_INDEX}"'
    fresh = launch_block(script("slurm", command=CMD + ["--train.resume="]))
    assert "--train.resume=" in fresh and "--train.resume=auto" not in fresh
    doctor = launch_block(script("slurm", command=["doctor"]))
    assert doctor[-1] == "--json=${ATTEMPT_DIR}/doctor.json"
    assert not any("resume" in w for w in doctor)


def test_run_dir_names_the_directory_and_is_checked(capsys):
    text = script("slurm", run_dir="~/runs/gpt small")
    assert _run_dir_line(text) == "RUN_DIR=\"${HOME}\"'/runs/gpt small'"
    assert "RUN_ROOT=" not in text
    arr = script("slurm", run_dir="sweep-{array_index}/x", array="0-3")
    assert _run_dir_line(arr) == "RUN_DIR=sweep-\"${ARRAY_INDEX}\"/x"
    with pytest.raises(JobError, match=r"put \{array_index\} in it"):
        script("slurm", run_dir="sweep", array="0-3")
    with pytest.raises(JobError, match="drop --run-root"):
        script("slurm", run_dir="a", run_root="b")
    with pytest.raises(JobError, match="drop --train.out_dir: .* use --run-dir DIR"):
        script("slurm", command=CMD + ["--train.out_dir=/x"])
    assert main(["jobscript", "--system", "slurm", "--nodes", "1", "--ranks-per-node", "2",
                 "--walltime", "01:00:00", "--venv", "none", "--run-dir", "runs/a",
                 "--stop-exit-code", "0", "--", *CMD]) == 0
    out = capsys.readouterr().out.replace("\n#    ", " ")
    assert "--venv none --run-dir runs/a --stop-exit-code 0 -- train default" in out


def test_an_early_stop_exits_with_the_documented_status():
    text = script("slurm")
    assert '-m hpctrain.train.run_status "$RUN_DIR"' in text
    assert 'echo "75" > "$ATTEMPT_DIR/exit_code"' in text and "\n    exit 75\n" in text
    assert "resubmit this script or requeue the job to continue" in text
    # A stop before the first step saved nothing, and says so.
    assert "stopped before the first step (${REASON:-a signal}), nothing trained yet" in text
    chained = script("slurm", stop_exit_code=0)
    assert "\n    exit 0\n" in chained
    with pytest.raises(JobError, match="0 to 255"):
        script("slurm", stop_exit_code=256)
    assert "run_status" not in script("slurm", command=["doctor"])


def test_the_records_of_attempts_are_found_newest_last(tmp_path):
    assert latest_attempt(tmp_path) is None
    for name in ("777", "777.2", "801"):
        (tmp_path / "jobs" / name).mkdir(parents=True)
        time.sleep(0.01)
    assert [p.name for p in attempts(tmp_path)] == ["777", "777.2", "801"]
    assert latest_attempt(tmp_path).name == "801"


def test_attempts_go_by_the_time_they_were_made_not_their_names(tmp_path):
    """Job ids outgrow a digit ("999" sorts after "1000" by name) and requeues pass
    ".9" (".10" sorts before it): the order is the folders' times."""
    made = ["999", "999.9", "999.10", "1000"]
    for t, name in enumerate(made):
        folder = tmp_path / "jobs" / name
        folder.mkdir(parents=True)
        os.utime(folder, (1_000_000 + t, 1_000_000 + t))
    assert [p.name for p in attempts(tmp_path)] == made
    assert latest_attempt(tmp_path).name == "1000"


def test_status_file_round_trip_and_the_line_a_script_reads(tmp_path, capsys):
    assert read_status(tmp_path) is None and shell_line(None) == "unknown 0 0"
    write_status(tmp_path, status_record("stopped", 120, 2000, "the time limit"))
    assert shell_line(read_status(tmp_path)) == "stopped 120 2000 the time limit"
    assert status_main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == "stopped 120 2000 the time limit\n"
    line = subprocess.run(["bash", "-c", f'read -r S STEP MAX R <<< "{shell_line(read_status(tmp_path))}"; '
                           'echo "$S|$STEP|$MAX|$R"'], capture_output=True, text=True)
    assert line.stdout == "stopped|120|2000|the time limit\n"
    write_status(tmp_path, status_record("finished", 2000, 2000))
    assert read_status(tmp_path) == {"status": "finished", "step": 2000, "max_iters": 2000}


# ------------------------------------------------------------------------ walltime

def _fake(stdout: str, returncode: int = 0):
    def run(argv, **kwargs):
        run.argv, run.env = argv, kwargs.get("env", {})
        return subprocess.CompletedProcess(argv, returncode, stdout, "")
    return run


def test_the_job_end_comes_from_squeue_as_slurm_22_05_gives_it():
    run = _fake("2026-11-26T17:00:00\n")
    end, source = job_end.job_end({"SLURM_JOB_ID": "42"}, 600, run=run)
    assert run.argv == ["squeue", "-h", "-j", "42", "-o", "%e"]
    assert run.env["SLURM_TIME_FORMAT"] == "standard"
    assert (end, source) == (datetime(2026, 11, 26, 17, 0, 0).timestamp(), "squeue")
    # squeue missing or failing: the walltime the script was made with, from the start.
    end, source = job_end.job_end({"SLURM_JOB_ID": "42", JOB_START_ENV: "1000"}, 600,
                                  run=_fake("", 1))
    assert (end, source) == (1600, "walltime")
    assert job_end.job_end({"SLURM_JOB_ID": "42"}, None, run=_fake("Unknown\n")) is None


def test_the_job_end_comes_from_qstat_start_plus_walltime():
    qstat = ("Job Id: 4242.polaris-pbs-01\n    Job_Name = hpctrain\n"
             "    Resource_List.walltime = 01:30:00\n    stime = Thu Nov 26 16:00:00 2026\n"
             "    resources_used.walltime = 00:00:05\n")
    run = _fake(qstat)
    end, source = job_end.job_end({"PBS_JOBID": "4242.polaris-pbs-01"}, 600, run=run)
    assert run.argv == ["qstat", "-f", "4242.polaris-pbs-01"]
    assert (end, source) == (datetime(2026, 11, 26, 16, 0).timestamp() + 5400, "qstat")


def test_the_deadline_takes_the_schedulers_end_over_the_generated_walltime():
    start = 1000.0
    d = Deadline.from_config(0, env={JOB_START_ENV: str(start), JOB_END_ENV: "1300"})
    assert d.end == 1300 and d.base == pytest.approx(0.05 * 300)
    # sbatch --time=... longer than the walltime the script was made with: the job's end
    # counts, not a stale limit (the script no longer passes --train.time_limit).
    assert Deadline.from_config(0, env={JOB_START_ENV: str(start), JOB_END_ENV: "5000"}).end \
        == 5000
    # A user's own --train.time_limit still caps it.
    d = Deadline.from_config(100, env={JOB_START_ENV: str(start), JOB_END_ENV: "5000"})
    assert d.end == 1100
    assert Deadline.from_config(0, env={JOB_END_ENV: ""}).end is None


def test_scripts_export_the_job_end_and_no_stale_time_limit():
    text = script("perlmutter")
    assert 'read -r HPCTRAIN_JOB_END JOB_END_FROM <<< "$("$PYTHON" -m ' \
           'hpctrain.jobs.job_end 1800)"' in text
    assert "export HPCTRAIN_JOB_END" in text
    assert not any("time_limit" in w for w in launch_block(text))
    assert "job_end" not in script("local")


def test_a_signal_lead_over_a_quarter_of_the_walltime_is_a_warning(capsys):
    assert signal_lead(["--signal=USR1@120"], 480) == ()
    (warning,) = signal_lead(["--output=x", "--signal=B:USR1@120"], 300)
    assert warning.startswith("--signal=B:USR1@120 sends SIGUSR1 120 s before the end of "
                              "the 00:05:00 walltime, more than a quarter of it")
    assert signal_lead(["--signal=USR1@120"], None) == ()
    assert main(["jobscript", "--system", "slurm", "--nodes", "1", "--ranks-per-node", "2",
                 "--walltime", "00:02:00", "--venv", "none", "--", *CMD]) == 0
    err = capsys.readouterr().err
    assert "warning: --signal=USR1@120 sends SIGUSR1 120 s before the end" in err
    assert "sbatch --signal=USR1@12 SCRIPT" in err


def test_frontier_and_the_cray_systems_ask_for_what_the_job_needs():
    frontier = directives(script("frontier"))
    for line in ("#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=7", "#SBATCH -S 8",
                 "#SBATCH --exclusive"):
        assert line in frontier
    for system in ("polaris", "perlmutter", "frontier"):
        assert "export MPICH_MAX_THREAD_SAFETY=multiple\n" in script(system), system


# ------------------------------------------------- an attempt killed before its first save

KILL_TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32",
             "--model.block_size=16", "--train.batch_size=8", "--train.log_interval=2",
             "--train.eval_interval=0", "--train.final_eval=false", "--train.sample_tokens=0",
             "--train.progress=false", "--data.verify=false"]


@pytest.mark.slow
def test_an_attempt_killed_before_its_first_save_is_set_aside_by_the_next(dataset_path,
                                                                          tmp_path):
    """Issue 39, item 1, under the suite's MPI (MPICH here, Open MPI in make test-openmpi):
    a job killed with SIGKILL, launcher and ranks at once, before its first checkpoint
    leaves metrics, a config and a stale lock; its next attempt, run with
    ``--train.resume=auto`` as job scripts do, moves them into previous-<time>/ and trains
    to the end."""
    out = tmp_path / "run"
    train = hpctrain_cmd("train", "default", f"--data.path={dataset_path}",
                         f"--train.out_dir={out}", *KILL_TINY, "--train.resume=auto")
    job = subprocess.Popen(mpiexec(2, *train, "--train.max_iters=100000",
                                   "--train.ckpt_interval=100000"),
                           env=launcher().environ(OMP_NUM_THREADS="1"), start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    try:
        for _ in range(600):  # polled a bounded number of times (a hang fails here)
            if metrics.exists() and metrics.stat().st_size:
                break
            time.sleep(0.2)
        else:
            pytest.fail("training did not start")
    finally:
        _kill_the_job(job, out)
    killed = metrics.read_text()
    assert not (out / "checkpoints" / "latest").exists()

    p = run(mpiexec(2, *train, "--train.max_iters=6"), timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--train.resume=auto found no checkpoint to continue" in p.stdout + p.stderr
    (previous,) = out.glob("previous-*")
    assert (previous / "metrics.jsonl").read_text() == killed
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines()]
    assert [s for s in steps if s is not None] == [2, 4, 6], steps  # a fresh history
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["world_size"]) == ("finished", 2)
    assert (out / "checkpoints" / "latest").read_text().strip().endswith("6")


def _kill_the_job(job: subprocess.Popen, out) -> None:
    """SIGKILL to the launcher and every rank at once, as a node failure or a scheduler's
    kill does (Open MPI puts each rank in a process group of its own: found by name)."""
    ranks = subprocess.run(["pgrep", "-f", f"train.out_dir={out}"], capture_output=True,
                           text=True).stdout.split()
    os.killpg(job.pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(timeout=60)
    for _ in range(300):  # until no rank is left (bounded: a survivor fails the test)
        if not subprocess.run(["pgrep", "-f", f"train.out_dir={out}"],
                              capture_output=True).stdout:
            return
        time.sleep(0.1)
    pytest.fail("a rank outlived SIGKILL")
