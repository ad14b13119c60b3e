"""An asynchronous checkpoint interrupted while its writer thread writes, in real
2-rank jobs under mpiexec: a rank killed with SIGKILL (the writer is a thread of the
rank, so it dies with it), a full disk (a real tmpfs) and SIGTERM. Each write is held
``SLOW_SAVE_S`` seconds by the test-only switch, so that the interruption lands while
it is in flight. The previous checkpoint stays ``latest`` and loadable; after SIGTERM
the in-flight one and the stop's are published too."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from hpctrain.checkpoint.ckpt_commands import inspect
from hpctrain.checkpoint.distributed import SLOW_SAVE_ENV
from tests.full_disk import fill, small_filesystem
from tests.helpers import hpctrain_cmd, launcher, mpiexec, run

pytestmark = pytest.mark.slow
SLOW_SAVE_S = 3
TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16",
        "--train.batch_size=8", "--train.log_interval=5", "--train.eval_interval=0",
        "--train.sample_tokens=0", "--train.progress=false", "--data.verify=false",
        "--train.ckpt_async=true", "--train.ckpt_interval=5"]


def _train(dataset_path, out, *extra) -> list[str]:
    return mpiexec(2, *hpctrain_cmd("train", "default", f"--data.path={dataset_path}",
                                    f"--train.out_dir={out}", *TINY, *extra))


def _start(dataset_path, out, *extra) -> subprocess.Popen:
    return subprocess.Popen(_train(dataset_path, out, "--train.max_iters=100000", *extra),
                            env=launcher().environ(OMP_NUM_THREADS="1",
                                                   **{SLOW_SAVE_ENV: str(SLOW_SAVE_S)}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(what: str, ready, job: subprocess.Popen) -> None:
    for _ in range(1200):  # polled a bounded number of times (60 s): a hang fails here
        if ready():
            return
        if job.poll() is not None:
            pytest.fail(f"the job ended ({job.returncode}) before {what}: "
                        f"{job.communicate()[1][-2000:]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _latest(root) -> str | None:
    try:
        return (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def _writing(root, step: int) -> bool:
    """The asynchronous save of ``step`` is in flight (its hidden folder exists)."""
    return any(root.glob(f".step_{step:06d}.*.tmp"))


def _logged_past(out, step: int) -> bool:
    """metrics.jsonl holds a step after ``step``."""
    path = out / "metrics.jsonl"
    return path.exists() and any(json.loads(line).get("step", 0) > step
                                 for line in path.read_text().splitlines()
                                 if line.endswith("}"))


def _after_step_5_while_10_is_written(job, root) -> None:
    _wait_for("step 5 published", lambda: _latest(root) == "step_000005", job)
    _wait_for("the save of step 10 in flight", lambda: _writing(root, 10), job)


def _stop(job) -> tuple[str, str]:
    try:
        return job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def test_a_rank_killed_during_an_async_write_leaves_the_previous_checkpoint(dataset_path,
                                                                           tmp_path):
    out = tmp_path / "run"
    root = out / "checkpoints"
    job = _start(dataset_path, out)
    try:
        _after_step_5_while_10_is_written(job, root)
        ranks = subprocess.run(["pgrep", "-f", f"python.*train.out_dir={out}"],
                               capture_output=True, text=True).stdout.split()
        os.kill(max(int(pid) for pid in ranks if int(pid) != job.pid), signal.SIGKILL)
    finally:
        _stop(job)
    assert job.returncode != 0
    assert _latest(root) == "step_000005" and "verified" in inspect(root, verify=True)
    assert not (root / "step_000010").exists()
    p = run(_train(dataset_path, out, "--train.max_iters=7", "--train.resume=auto"),
            timeout=180)
    assert p.returncode == 0, p.stderr
    assert "resumed from the checkpoint of step 5" in p.stdout
    assert not any(root.glob(".step_*")), "the killed save's temporary was left"


def test_a_full_disk_during_an_async_write_is_one_line_and_exit_2(dataset_path, tmp_path):
    """A run's checkpoint of step 5 moves to a 4 MiB tmpfs that becomes its checkpoints
    folder (metrics.jsonl and the rest stay on the ordinary disk); the resumed run's
    asynchronous save of step 10 finds it filled while it waits to write."""
    with small_filesystem("4m") as point:
        if point is None:
            pytest.skip(small_filesystem.why)
        out = tmp_path / "run"
        root = out / "checkpoints"
        p = run(_train(dataset_path, out, "--train.max_iters=5"), timeout=180)
        assert p.returncode == 0, p.stderr
        for item in root.iterdir():
            shutil.move(item, point / item.name)
        root.rmdir()
        root.symlink_to(point)
        job = subprocess.Popen(
            _train(dataset_path, out, "--train.max_iters=100000", "--train.resume=auto"),
            env=launcher().environ(OMP_NUM_THREADS="1", **{SLOW_SAVE_ENV: str(SLOW_SAVE_S)}),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for("the save of step 10 in flight", lambda: _writing(root, 10), job)
            fill(point)
        finally:
            stdout, stderr = _stop(job)
        (point / "filler").unlink()
        assert job.returncode == 2, stderr
        errors = [line for line in stderr.splitlines() if "saving checkpoint step 10" in line]
        assert errors and "No space left on device" in errors[0], stderr
        assert "Traceback" not in stderr
        assert _latest(root) == "step_000005" and "verified" in inspect(root, verify=True)
        assert not any(root.glob(".step_*")) and not (root / "step_000010").exists()


def test_sigterm_during_an_async_write_publishes_it_and_the_stops_checkpoint(dataset_path,
                                                                             tmp_path):
    if launcher().family == "openmpi":
        pytest.skip("Open MPI's mpirun follows SIGTERM with SIGKILL 1-2 s later: a save "
                    "held 3 s cannot finish")
    out = tmp_path / "run"
    root = out / "checkpoints"
    job = _start(dataset_path, out, "--train.log_interval=1")
    try:
        # Past step 5 with its save in flight: a signal that came before the loop's stop
        # check of step 5 would stop at 5 itself, leaving no second checkpoint to make.
        _wait_for("a step after 5 while its save is in flight",
                  lambda: _writing(root, 5) and _logged_past(out, 5), job)
        job.send_signal(signal.SIGTERM)
    finally:
        stdout, stderr = _stop(job)
    assert job.returncode == 0, stderr
    assert "stopped by SIGTERM after step" in stdout, stdout
    stopped = int(_latest(root).split("_")[1])
    assert stopped > 5 and "verified" in inspect(root / f"step_{stopped:06d}", verify=True)
    assert "verified" in inspect(root / "step_000005", verify=True)
    assert "checkpoint: " in stdout and "(written during" in stdout
