"""Generated job scripts and ``hpctrain launch`` under a real Slurm (the `slurm` leg).

``make test-slurm`` runs this file inside ``tests/slurm_harness.py``: a one-node cluster of
Debian's ``slurm-wlm`` on this machine (slurmctld, slurmd, munged), ``MpiDefault=none``
as on many sites, accounting off. Elsewhere (``HPCTRAIN_TEST_SLURM`` unset) it is skipped.

The three time-limit jobs (1 minute each; Slurm enforces limits on a ~30 s tick, so one
runs ~90 s) are submitted first and checked last, while the other jobs share the node
(the partition oversubscribes its 2 cores): the leg takes about as long as one of them,
plus a requeue and a resubmission of one of them (issue 29, item 1).
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


def run_dir(submit: Path, name: str) -> Path:
    """A job's run directory: named by the job, the same for every attempt."""
    return submit / "runs" / name


def records(submit: Path, name: str, job_id: str) -> Path:
    """One attempt's records (jobscript.sh, launch.txt, exit_code, ...)."""
    return run_dir(submit, name) / "jobs" / job_id


def exit_code(info: dict) -> str:
    """``ExitCode=2:0`` -> ``2:0`` (status : the signal that ended the script, if any)."""
    return info.get("ExitCode", "?")


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
      ``--signal`` line) nor the trainer's own stop (``--train.time_limit=0`` and no
      ``$HPCTRAIN_JOB_END``): SIGTERM at the limit, to the ranks and to the script.
    - ``requeue``: 2 ranks, made for 10 minutes without the early signal and submitted
      with ``sbatch --time=1``: the trainer asks squeue for the job's end (Slurm 22.05 has
      no ``$SLURM_JOB_END_TIME``) and stops before the real limit, not the script's."""
    long = ["train", "default", f"--data.path={data}", *TINY, "--train.max_iters=10000000",
            "--train.log_interval=500"]
    usr1 = jobscript(submit, "usr1.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                         "--walltime", "00:01:00"], long)
    term = jobscript(submit, "term.sh", ["--nodes", "1", "--ranks-per-node", "1",
                                         "--walltime", "00:01:00"],
                     long + ["--train.time_limit=0"])
    _drop_signal_directive(term)
    term.write_text(term.read_text().replace("export HPCTRAIN_JOB_END\n",
                                             "HPCTRAIN_JOB_END=\n"))
    requeue = jobscript(submit, "requeue.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                               "--walltime", "00:10:00"],
                        long[:-1] + ["--train.log_interval=10", "--train.ckpt_interval=50"])
    _drop_signal_directive(requeue)
    return {"usr1": sbatch(usr1, "--signal=USR1@30"), "term": sbatch(term),
            "requeue": sbatch(requeue, "--time=1")}


def _drop_signal_directive(script: Path) -> None:
    script.write_text("".join(line for line in script.read_text().splitlines(keepends=True)
                              if not line.startswith("#SBATCH --signal")))


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
    rd, attempt = run_dir(submit, "train2"), records(submit, "train2", job)
    assert (attempt / "exit_code").read_text() == "0\n"
    summary = json.loads((rd / "summary.json").read_text())
    assert (summary["world_size"], summary["status"]) == (2, "finished")
    lines = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [5, 10, 15, 20]
    launch = shlex.split((attempt / "launch.txt").read_text())
    assert launch[:5] == ["srun", "--mpi=pmi2", "-n", "2", "--ntasks-per-node=2"], launch
    assert "srun --mpi=pmi2 (MPICH" in out  # chosen in the job, for the pip mpich wheel
    assert f"hpctrain job: finished; results in {rd}" in out
    assert "(from squeue)" in (attempt / "job.txt").read_text()
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
    assert (records(submit, "nompi", job) / "exit_code").read_text() == "2\n"
    assert not (run_dir(submit, "nompi") / "metrics.jsonl").exists()


def test_a_user_error_on_every_rank_is_status_2_under_srun_not_137(submit, data):
    """Issue 29, item 2: every rank raised the same error and called MPI_Abort(2); srun
    then killed the step and the job recorded 137 (SIGKILL), which reads as an
    out-of-memory kill. The ranks now agree and exit 2 themselves."""
    script = jobscript(submit, "usererr.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                              "--walltime", "00:05:00"],
                       ["train", "default", f"--data.path={submit}/missing.h5", *TINY])
    job = sbatch(script)
    info = wait_job(job)
    out = job_output(submit, "usererr", job)
    assert (info["JobState"], exit_code(info)) == ("FAILED", "2:0"), out
    assert out.count("does not exist") == 1, out  # once for the job, not once per rank
    assert "MPI_Abort" not in out and "137" not in out, out
    assert "hpctrain job: FAILED: the launcher exited with status 2" in out
    assert (records(submit, "usererr", job) / "exit_code").read_text() == "2\n"
    comp = Path(os.environ["HPCTRAIN_SLURM_JOBCOMP"]).read_text()
    assert re.search(rf"JobId={job} .*JobState=FAILED .*ExitCode=2:0", comp), comp


def test_early_signal_stops_training_with_a_checkpoint_before_the_limit(submit, limit_jobs):
    from hpctrain.checkpoint.sharded import read_manifest

    job = limit_jobs["usr1"]
    info = wait_job(job)
    out = job_output(submit, "usr1", job)
    # Stopped early with a checkpoint: exit 75 (hpctrain jobscript --stop-exit-code), so
    # that Slurm (RequeueExit=75), afterok chains and the user tell it from a finished run.
    assert (info["JobState"], exit_code(info)) == ("FAILED", "75:0"), out
    assert "stopped by SIGUSR1 after step" in out, out
    rd = run_dir(submit, "usr1")
    assert (records(submit, "usr1", job) / "exit_code").read_text() == "75\n"
    manifest = read_manifest(rd)
    assert manifest.world_size == 2 and manifest.step > 0
    assert f"hpctrain job: stopped after step {manifest.step} of 10000000 (SIGUSR1), " \
        f"checkpoint saved in {rd}; resubmit this script or requeue the job to continue " \
        "(exit status 75)" in out, out
    assert json.loads((rd / "status.json").read_text())["reason"] == "SIGUSR1"


def test_a_job_killed_at_its_time_limit_leaves_exit_code(submit, limit_jobs):
    job = limit_jobs["term"]
    info = wait_job(job)
    out = job_output(submit, "term", job)
    assert info["JobState"] == "TIMEOUT", out
    assert "hpctrain job: received SIGTERM" in out, out
    code = (records(submit, "term", job) / "exit_code").read_text().strip()
    assert code.isdigit(), code  # the launcher's status, or 143 if SIGKILL came first
    print(f"time-limit job {job}: exit_code {code}, run time {info.get('RunTime')}")


STOPPED = re.compile(r"hpctrain job: stopped after step (\d+) of 10000000 \(the time limit\), "
                     r"checkpoint saved in (\S+); resubmit this script or requeue the job to "
                     r"continue \(exit status 75\)")


def _stopped_step(out: str) -> int:
    found = STOPPED.findall(out)
    assert found, out
    return int(found[-1][0])  # a requeued job's output file may hold both attempts


def test_a_requeued_job_and_a_resubmitted_one_continue_from_the_checkpoint(submit,
                                                                           limit_jobs):
    """Issue 29, items 1 and 5. The first attempt, made for 10 minutes but submitted with
    --time=1, stops before the 1-minute limit (the end comes from squeue), saves and exits
    75. ``scontrol requeue`` runs the same job id again: it resumes from that checkpoint in
    the same run directory, its records beside the first attempt's. A new submission of
    the same script (max_iters now within reach) resumes too and finishes (0)."""
    job = limit_jobs["requeue"]
    info = wait_job(job)
    out = job_output(submit, "requeue", job)
    assert (info["JobState"], exit_code(info)) == ("FAILED", "75:0"), out
    first = _stopped_step(out)
    rd, attempt = run_dir(submit, "requeue"), records(submit, "requeue", job)
    assert STOPPED.search(out).group(2) == str(rd)
    assert "(from squeue)" in (attempt / "job.txt").read_text()
    assert (attempt / "exit_code").read_text() == "75\n"
    status = json.loads((rd / "status.json").read_text())
    assert (status["status"], status["step"], status["reason"]) == \
        ("stopped", first, "the time limit")

    p = _run(["scontrol", "requeue", job], cwd=submit, timeout=30)
    assert p.returncode == 0, p.stderr
    time.sleep(2)  # the requeue is now PENDING, then RUNNING
    info = wait_job(job, timeout=JOB_TIMEOUT + 120)
    out = job_output(submit, "requeue", job)
    assert (info["JobState"], exit_code(info)) == ("FAILED", "75:0"), out
    assert f"resumed from the checkpoint of step {first}" in out, out
    second = _stopped_step(out)
    assert second > first
    again = rd / "jobs" / f"{job}.2"
    assert (again / "exit_code").read_text() == "75\n"
    assert "attempt 2" in (again / "job.txt").read_text()
    assert (attempt / "exit_code").read_text() == "75\n"  # the first attempt's, kept

    script = submit / "requeue.sh"
    script.write_text(script.read_text().replace("--train.max_iters=10000000",
                                                 f"--train.max_iters={second + 5}"))
    new_job = sbatch(script)
    info = wait_job(new_job)
    out = job_output(submit, "requeue", new_job)
    assert (info["JobState"], exit_code(info)) == ("COMPLETED", "0:0"), out
    assert f"resumed from the checkpoint of step {second}" in out, out
    assert f"hpctrain job: finished; results in {rd}" in out
    assert (records(submit, "requeue", new_job) / "exit_code").read_text() == "0\n"
    assert json.loads((rd / "summary.json").read_text())["status"] == "finished"
    steps = [json.loads(line).get("step") for line in
             (rd / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == second + 5  # one history, in order


def _ranks_of(marker: str) -> list[int]:
    """The PIDs of the ranks whose command line holds ``marker`` (this is the node)."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    ranks = []
    for pid in found.split():
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("python"):  # not srun
                ranks.append(int(pid))
        except OSError:
            pass
    return ranks


def _wait_for_ranks(marker: str, metrics: Path, count: int = 2) -> list[int]:
    """Ranks running and training: ``count`` PIDs and a first metrics record, polled a
    bounded number of times."""
    for _ in range(JOB_TIMEOUT * 5):
        ranks = _ranks_of(marker)
        if len(ranks) >= count and metrics.exists() and metrics.stat().st_size:
            return ranks
        time.sleep(0.2)
    raise AssertionError(f"the ranks of {marker} did not start training")


def _sigkill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def test_a_job_killed_before_its_first_save_trains_to_the_end_when_requeued(submit, data):
    """Issue 39, item 1: the ranks of a job SIGKILLed before its first checkpoint (a node
    failure, the OOM killer) leave metrics, a config and a stale lock in the run
    directory. ``scontrol requeue`` runs the job again with ``--train.resume=auto``: it
    moves the killed attempt's outputs into previous-<time>/ and trains to the end."""
    marker = "train.ckpt_interval=99991"  # this job's ranks, found by their arguments
    script = jobscript(submit, "killed.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                             "--walltime", "00:05:00"],
                       ["train", "default", f"--data.path={data}", *TINY,
                        "--train.max_iters=1500", "--train.log_interval=2", f"--{marker}"])
    job = sbatch(script)
    rd = run_dir(submit, "killed")
    _sigkill(_wait_for_ranks(marker, rd / "metrics.jsonl"))
    info = wait_job(job)
    out = job_output(submit, "killed", job)
    assert info["JobState"] == "FAILED", out
    assert not (rd / "checkpoints" / "latest").exists(), out
    killed = (rd / "metrics.jsonl").read_text()

    p = _run(["scontrol", "requeue", job], cwd=submit, timeout=30)
    assert p.returncode == 0, p.stderr
    time.sleep(2)  # the requeue is now PENDING, then RUNNING
    info = wait_job(job)
    out = job_output(submit, "killed", job)
    assert (info["JobState"], exit_code(info)) == ("COMPLETED", "0:0"), out
    assert "--train.resume=auto found no checkpoint to continue" in out, out
    (previous,) = rd.glob("previous-*")
    assert (previous / "metrics.jsonl").read_text() == killed
    assert f"hpctrain job: finished; results in {rd}" in out
    assert (rd / "jobs" / f"{job}.2" / "exit_code").read_text() == "0\n"
    assert json.loads((rd / "summary.json").read_text())["status"] == "finished"
    steps = [json.loads(line).get("step") for line in
             (rd / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s is not None]
    assert steps[0] == 2 and steps[-1] == 1500, steps  # one fresh history


def test_a_config_error_under_srun_is_one_line_and_status_2_before_mpi(submit, tmp_path):
    """Issue 39, item 2: a typo in an option is found before MPI starts, on every rank;
    srun's two tasks exit 2, rank 0 alone prints the line, no rank calls MPI_Abort. (The
    user error after MPI started is test_a_user_error_on_every_rank_is_status_2_...)"""
    p = _run(["srun", "-n", "2", "-t", "5", "--job-name=cfgerr", "--kill-on-bad-exit=1",
              sys.executable, "-m", "hpctrain", "train", "default",
              "--train.max_iter=5"], cwd=tmp_path, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    errors = [line for line in p.stderr.splitlines() if not line.startswith("srun:")]
    assert errors == ["error: unknown option --train.max_iter; did you mean "
                      "--train.max_iters?"], p.stderr
    assert "MPI_Abort" not in p.stdout + p.stderr
    comp = Path(os.environ["HPCTRAIN_SLURM_JOBCOMP"]).read_text()
    assert re.search(r"JobId=\d+ .*Name=cfgerr .*JobState=FAILED .*ExitCode=2:0", comp), comp
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_rank_that_dies_ends_the_job_at_once_not_at_the_comm_timeout(submit, data):
    """Issue 39, item 7: one rank killed (SIGKILL); the other waits in a collective for it.
    srun's --kill-on-bad-exit=1 (in the generated line) ends the step when the first task
    dies: the job ends within wait_job's limit, far under --comm.timeout (the watchdog's
    verdict, which would otherwise be the first to end it)."""
    marker = "train.ckpt_interval=99992"
    script = jobscript(submit, "deadrank.sh", ["--nodes", "1", "--ranks-per-node", "2",
                                               "--walltime", "00:05:00"],
                       ["train", "default", f"--data.path={data}", *TINY,
                        "--train.max_iters=10000000", "--train.log_interval=100",
                        "--comm.timeout=3600", f"--{marker}"])
    job = sbatch(script)
    ranks = _wait_for_ranks(marker, run_dir(submit, "deadrank") / "metrics.jsonl")
    _sigkill([max(ranks)])  # one rank: the one started last
    info = wait_job(job, timeout=90)  # a step left to the watchdog runs an hour
    out = job_output(submit, "deadrank", job)
    assert info["JobState"] == "FAILED", out
    assert "CommTimeout" not in out, out
    code = (records(submit, "deadrank", job) / "exit_code").read_text().strip()
    assert code.isdigit() and code != "0", code
