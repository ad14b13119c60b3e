"""A SIGTERM to the launcher leaves the ranks time for a stop's save (issue 39, item 7's
Open MPI half). Open MPI's mpirun kills the ranks ``odls_base_sigkill_timeout`` seconds
(default 1) after it forwards SIGTERM; the job scripts and ``hpctrain launch`` set it to
``OMPI_SIGKILL_S``. Runs in the `slow` leg (MPICH's Hydra waits for the ranks anyway) and in
``make test-openmpi``, where it matters."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from hpctrain.checkpoint.distributed import SLOW_SAVE_ENV
from hpctrain.jobs.launch_line import OMPI_SIGKILL_ENV, OMPI_SIGKILL_S, run_launch
from hpctrain.train.rundir_lock import LOCK_NAME
from tests.helpers import hpctrain_cmd, launcher, mpiexec

TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16",
        "--train.batch_size=8", "--train.log_interval=2", "--train.eval_interval=0",
        "--train.final_eval=false", "--train.sample_tokens=0", "--train.progress=false",
        "--data.verify=false", "--train.max_iters=1000000", "--train.ckpt_interval=1000000"]
SLOW_SAVE_S = 3  # more than Open MPI's default of 1 s, well within OMPI_SIGKILL_S


@pytest.mark.slow
def test_a_save_slower_than_open_mpis_default_finishes_after_sigterm(dataset_path, tmp_path):
    out = tmp_path / "run"
    env = launcher().environ(OMP_NUM_THREADS="1", **{SLOW_SAVE_ENV: str(SLOW_SAVE_S),
                                                     OMPI_SIGKILL_ENV: str(OMPI_SIGKILL_S)})
    job = subprocess.Popen(mpiexec(2, *hpctrain_cmd(
        "train", "default", f"--data.path={dataset_path}", f"--train.out_dir={out}", *TINY)),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):  # polled a bounded number of times
            if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size:
                break
            time.sleep(0.2)
        else:
            pytest.fail("training did not start")
        job.send_signal(signal.SIGTERM)  # the batch system at the walltime, scancel, qdel
        stdout, stderr = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    # Open MPI's mpirun exits 1 after its SIGTERM even when the ranks exited 0.
    assert "stopped by SIGTERM after step" in stdout, stdout + stderr
    status = json.loads((out / "status.json").read_text())
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (status["status"], f"step_{status['step']:06d}") == ("stopped", latest)
    assert not (out / LOCK_NAME).exists()  # released, not left stale by a SIGKILL


def test_hpctrain_launch_gives_open_mpi_ranks_time_and_keeps_the_users_value(monkeypatch,
                                                                            capfd):
    show = [sys.executable, "-c", f"import os; print(os.environ['{OMPI_SIGKILL_ENV}'])"]
    monkeypatch.delenv(OMPI_SIGKILL_ENV, raising=False)
    assert run_launch(show) == 0
    assert capfd.readouterr().out.splitlines()[-1] == str(OMPI_SIGKILL_S)
    monkeypatch.setenv(OMPI_SIGKILL_ENV, "42")
    assert run_launch(show) == 0
    assert capfd.readouterr().out.splitlines()[-1] == "42"


def test_scripts_that_run_mpirun_set_the_sigkill_timeout_and_srun_scripts_do_not():
    from tests.jobs_common import script

    line = f"export {OMPI_SIGKILL_ENV}=${{{OMPI_SIGKILL_ENV}:-{OMPI_SIGKILL_S}}}\n"
    for system in ("pbs", "local", "polaris"):
        text = script(system)
        assert line in text, system
        assert text.index(line) < text.index('"${LAUNCH[@]}" &')
    assert f"export {OMPI_SIGKILL_ENV}" not in script("slurm")
