"""Jobs that never hang: a stalled rank trips the watchdog with a message saying where,
and a killed rank ends the whole job. Real mpiexec, real training, under time limits."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import hpctrain_cmd, launcher, mpiexec, run

pytestmark = pytest.mark.slow

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
        "--train.batch_size=8", "--train.log_interval=5", "--train.eval_interval=0",
        "--train.sample_tokens=0", "--train.progress=false", "--data.verify=false"]


PIPELINE = ["--parallel.pp=2", "--parallel.micro_batches=2"]


@pytest.mark.parametrize("extra,waits_in", [([], "gradient reduction"),
                                            (PIPELINE, "pipeline stage 0: recv_grad")])
def test_a_stalled_rank_trips_the_watchdog_naming_rank_step_and_operation(dataset_path,
                                                                          tmp_path, extra,
                                                                          waits_in):
    # Rank 1 stops answering at step 6; rank 0 waits in the gradient reduction (data
    # parallel) or for stage 1's gradient (pipeline).
    script = tmp_path / "stall.py"
    script.write_text(
        "import sys, time\n"
        "from hpctrain.train.trainer import Trainer\n"
        "step = Trainer.train_step\n"
        "def stalled(self, s):\n"
        "    if self.world.rank == 1 and s == 5:\n"
        "        time.sleep(120)\n"
        "    return step(self, s)\n"
        "Trainer.train_step = stalled\n"
        "from hpctrain.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    # The watchdog (--comm.timeout=3) ends the job; a hang runs into run()'s limit.
    p = run(mpiexec(2, sys.executable, str(script), "train", "default",
                    f"--data.path={dataset_path}", f"--train.out_dir={tmp_path}/out",
                    "--comm.timeout=3", "--train.max_iters=50", *TINY, *extra), timeout=90)
    assert p.returncode != 0
    assert "[rank 0/2]" in p.stderr and f"CommTimeout: step 6: {waits_in}" in p.stderr
    assert "did not complete within 3 s (--comm.timeout)" in p.stderr


def test_killing_one_rank_ends_the_job(dataset_path, tmp_path):
    out = tmp_path / "killed-run"
    job = _start_training(dataset_path, out, "--train.max_iters=100000")
    try:
        _wait_for_metrics(out)
        found = subprocess.run(["pgrep", "-f", f"python.*train.out_dir={out}"],
                               capture_output=True, text=True).stdout.split()
        victim = max(int(pid) for pid in found if int(pid) != job.pid)  # a rank, not mpiexec
        os.kill(victim, signal.SIGKILL)
        rc = job.wait(timeout=60)  # a job left hanging raises TimeoutExpired
        assert rc != 0
    finally:
        if job.poll() is None:
            job.kill()
        job.communicate()


def _start_training(dataset_path, out, *extra):
    env = launcher().environ(OMP_NUM_THREADS="1")
    return subprocess.Popen(mpiexec(2, *hpctrain_cmd(
        "train", "default", f"--data.path={dataset_path}", f"--train.out_dir={out}", *TINY,
        *extra)), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_metrics(out, deadline_s=60):
    for _ in range(int(deadline_s / 0.2)):  # polled, a bounded number of times
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size:
            return
        time.sleep(0.2)
    pytest.fail("training did not start")


@pytest.mark.parametrize("extra,sig", [([], signal.SIGTERM), (PIPELINE, signal.SIGTERM),
                                       ([], signal.SIGUSR1), ([], signal.SIGINT)],
                         ids=["dp", "pipeline", "dp-usr1", "dp-ctrl-c"])
def test_sigterm_saves_a_checkpoint_exits_cleanly_and_resumes(dataset_path, tmp_path, extra,
                                                              sig):
    if sig in (signal.SIGTERM, signal.SIGINT) and launcher().family == "openmpi":
        pytest.skip("Open MPI's mpirun answers SIGTERM (and SIGINT) with the signal to the "
                    "ranks, then SIGKILL 1-2 s later, and exits 1: a save may not finish")
    out = tmp_path / "walltime"
    job = _start_training(dataset_path, out, "--train.max_iters=100000", *extra)
    try:
        _wait_for_metrics(out)
        job.send_signal(sig)  # what the batch system does at walltime (SIGUSR1: on request)
        stdout, stderr = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr
    assert f"stopped by {sig.name} after step" in stdout and "--train.resume=auto" in stdout
    latest = (out / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert 0 < stopped < 100000
    # Issue 29 items 1 and 3: Ctrl-C too; and the run says it stopped, and why.
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    status = json.loads((out / "status.json").read_text())
    assert (status["status"], status["step"], status["reason"]) == \
        ("stopped", stopped, sig.name)
    p = run(mpiexec(2, *hpctrain_cmd(
        "train", "default", f"--data.path={dataset_path}", f"--train.out_dir={out}", *TINY,
        f"--train.max_iters={stopped + 5}", "--train.resume=auto", *extra)), timeout=120)
    assert p.returncode == 0, p.stderr
    assert f"resumed from the checkpoint of step {stopped}" in p.stdout


def test_a_time_limit_ends_with_a_checkpoint_before_the_walltime(dataset_path, tmp_path):
    """``--train.time_limit=20`` with every save 2 s slower (a test-only switch): the run
    measures its saves, stops early enough, saves and exits 0 before a 'scheduler' kills
    the whole job 20 s after its start (whatever the launcher does with signals)."""
    from hpctrain.checkpoint.distributed import SLOW_SAVE_ENV
    from hpctrain.checkpoint.ckpt_commands import inspect
    from hpctrain.train.deadline import JOB_START_ENV

    out = tmp_path / "limit"
    env = {SLOW_SAVE_ENV: "2", JOB_START_ENV: f"{time.time():.3f}"}
    p = run(["timeout", "-s", "KILL", "20", *mpiexec(2, *hpctrain_cmd(
        "train", "default", f"--data.path={dataset_path}", f"--train.out_dir={out}", *TINY,
        "--train.max_iters=100000", "--train.ckpt_interval=10", "--train.time_limit=20"))],
        timeout=60, env=env)
    assert p.returncode == 0, f"status {p.returncode} (137: killed at the limit)\n{p.stderr}"
    assert "stopped by the time limit" in p.stdout, p.stdout
    assert "verified" in inspect(out / "checkpoints", verify=True)
