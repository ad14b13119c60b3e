"""Generated job scripts and ``hpctrain launch`` under a real Slurm (the `slurm` leg).

``make test-slurm`` runs this file inside ``tests/slurm_harness.py``: a one-node cluster of
Debian's ``slurm-wlm`` on this machine (slurmctld, slurmd, munged), ``MpiDefault=none``
as on many sites, accounting off. Elsewhere (``HPCTRAIN_TEST_SLURM`` unset) it is skipped.

The two time-limit jobs (1 minute each; Slurm enforces limits on a ~30 s tick, so one
runs ~90 s) are submitted first and checked last, while the other jobs share the node
(the partition oversubscribes its 2 cores): the leg takes about as long as one of them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(os.environ.get("HPCTRAIN_TEST_SLURM") != "1",
                                 reason="needs the one-node Slurm of make test-slurm "
                                        "(tests/slurm_harness.py)")]

TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16",
        "--train.batch_size=8", "--train.eval_interval=0", "--train.final_eval=false",
        "--train.sample_tokens=0", "--train.progress=false", "--train.threads=1"]
FINAL_STATES = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
JOB_TIMEOUT = 240


def _env(**extra) -> dict:
    """The submitting shell: the checkout under test first on the path of every rank
    (sbatch exports this environment to the job), one thread per rank."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def _run(argv, cwd, timeout=JOB_TIMEOUT, **extra) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(**extra), capture_output=True, text=True,
                          timeout=timeout)


def jobscript(submit: Path, name: str, options: list[str], command: list[str]) -> Path:
    path = submit / name
    p = _run([sys.executable, "-m", "hpctrain", "jobscript", "--system", "slurm",
              "--venv", sys.prefix, "--job-name", name.split(".")[0], "--output", str(path),
              *options, "--", *command], cwd=submit, timeout=60)
    assert p.returncode == 0, p.stderr
    return path


def sbatch(script: Path, *options: str) -> str:
    p = _run(["sbatch", "--parsable", *options, str(script)], cwd=script.parent, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


def job_state(job_id: str) -> dict:
    p = _run(["scontrol", "show", "job", "-o", job_id], cwd=REPO, timeout=30)
    assert p.returncode == 0, p.stderr
    return dict(re.findall(r"(\w+)=(\S*)", p.stdout))


def wait_job(job_id: str, timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_state(job_id)
        if info.get("JobState") in FINAL_STATES:
            return info
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {job_state(job_id).get('JobState')} after "
                         f"{timeout} s")


def job_output(submit: Path, name: str, job_id: str) -> str:
    out = submit / f"{name}-{job_id}.out"  # --output=%x-%j.out
    return out.read_text(errors="replace") if out.exists() else "(no output file)"


def run_dir(submit: Path, name: str, job_id: str) -> Path:
    return submit / "runs" / f"{name}-{job_id}"


@pytest.fixture(scope="module")
def submit(tmp_path_factory):
    return tmp_path_factory.mktemp("submit")


@pytest.fixture(scope="module")
def data(submit):
    from tests.helpers import make_dataset

    return make_dataset(submit / "tiny.h5")


@pytest.fixture(scope="module", autouse=True)
def limit_jobs(submit, data):
    """Submitted before the other tests run, checked by the last two tests.

    - ``usr1``: 2 ranks, a 1-minute limit, asks for SIGUSR1 30 s before it: the ranks
      save a checkpoint and exit 0 before the limit (COMPLETED).
    - ``term``: 1 rank, the same limit, without the early signal (the user deleted the
      ``--signal`` line) nor the trainer's own stop (``--train.time_limit=0``): SIGTERM
      at the limit, to the ranks and to the script."""
    long = ["train", "default", f"--data.path={data}", *TINY, "--train.max_iters=10000000",
            "--train.log_interval=500"]
    usr1 = jobscript(submit, "usr1.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                         "--walltime", "00:01:00"], long)
    term = jobscript(submit, "term.sh", ["--nodes", "1", "--ranks-per-node", "1",
                                         "--walltime", "00:01:00"],
                     long + ["--train.time_limit=0"])
    term.write_text("".join(line for line in term.read_text().splitlines(keepends=True)
                            if not line.startswith("#SBATCH --signal")))
    return {"usr1": sbatch(usr1, "--signal=USR1@30"), "term": sbatch(term)}


def test_sbatch_trains_on_two_ranks_wired_by_srun(submit, data):
    script = jobscript(submit, "train2.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                             "--walltime", "00:05:00"],
                       ["train", "default", f"--data.path={data}", "--train.max_iters=20",
                        "--train.log_interval=5", "--train.eval_iters=2",
                        "--train.sample_tokens=0", "--train.progress=false"])
    job = sbatch(script)
    info = wait_job(job)
    out = job_output(submit, "train2", job)
    assert info["JobState"] == "COMPLETED", out
    rd = run_dir(submit, "train2", job)
    assert (rd / "exit_code").read_text() == "0\n"
    assert json.loads((rd / "summary.json").read_text())["world_size"] == 2
    records = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20]
    launch = shlex.split((rd / "launch.txt").read_text())
    assert launch[:5] == ["srun", "--mpi=pmi2", "-n", "2", "--ntasks-per-node=2"], launch
    assert "srun --mpi=pmi2 (MPICH" in out  # chosen in the job, for the pip mpich wheel
    comp = Path(os.environ["HPCTRAIN_SLURM_JOBCOMP"]).read_text()
    assert re.search(rf"JobId={job} .*JobState=COMPLETED", comp)


def test_launch_inside_salloc_uses_the_allocations_two_ranks(submit, data, tmp_path):
    out = tmp_path / "out"
    command = ["train", "default", f"--data.path={data}", *TINY, "--train.max_iters=4",
               "--train.log_interval=2", f"--train.out_dir={out}"]
    launch = [sys.executable, "-m", "hpctrain", "launch"]
    p = _run(["salloc", "-n", "2", "-t", "5", *launch, "--dry-run", "--", *command],
             cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    line = shlex.split(p.stdout.strip().splitlines()[-1][2:])
    assert line[:5] == ["srun", "--mpi=pmi2", "-n", "2", "--ntasks-per-node=2"], p.stdout
    p = _run(["salloc", "-n", "2", "-t", "5", *launch, "--", *command], cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


def test_srun_without_an_mpi_plugin_is_stopped_at_start(submit, data):
    script = jobscript(submit, "nompi.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                            "--walltime", "00:05:00", "--srun-mpi", "none"],
                       ["train", "default", f"--data.path={data}", *TINY,
                        "--train.max_iters=4"])
    job = sbatch(script)
    info = wait_job(job)
    out = job_output(submit, "nompi", job)
    assert info["JobState"] == "FAILED", out
    assert "srun started 2 tasks but each is a 1-rank MPI job" in out
    assert "srun --mpi=pmix" in out
    assert (run_dir(submit, "nompi", job) / "exit_code").read_text() == "2\n"
    assert not (run_dir(submit, "nompi", job) / "metrics.jsonl").exists()


def test_early_signal_stops_training_with_a_checkpoint_before_the_limit(submit, limit_jobs):
    from hpctrain.checkpoint.sharded import read_manifest

    job = limit_jobs["usr1"]
    info = wait_job(job)
    out = job_output(submit, "usr1", job)
    assert info["JobState"] == "COMPLETED", out
    assert "stopped by SIGUSR1 after step" in out, out
    rd = run_dir(submit, "usr1", job)
    assert (rd / "exit_code").read_text() == "0\n"
    manifest = read_manifest(rd)
    assert manifest.world_size == 2 and manifest.step > 0
    assert str(manifest.step) in out  # the step it says it stopped after


def test_a_job_killed_at_its_time_limit_leaves_exit_code(submit, limit_jobs):
    job = limit_jobs["term"]
    info = wait_job(job)
    out = job_output(submit, "term", job)
    assert info["JobState"] == "TIMEOUT", out
    assert "hpctrain job: received SIGTERM" in out, out
    rd = run_dir(submit, "term", job)
    code = (rd / "exit_code").read_text().strip()
    assert code.isdigit(), code  # the launcher's status, or 143 if SIGKILL came first
    print(f"time-limit job {job}: exit_code {code}, run time {info.get('RunTime')}")
