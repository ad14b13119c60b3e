"""Generated job scripts executed end to end on this machine, in a fake batch environment.

The "cluster" is a temporary directory:

- ``home/.bash_profile`` puts the shims first on PATH and defines ``module`` as a shell
  function, as Lmod does in a login shell (the scripts run as ``#!/bin/bash -l``);
- ``bin/mpiexec`` stands in for PALS ``mpiexec``: it accepts the Polaris/Aurora flags
  (``--ppn``, ``--depth``, ``--cpu-bind``, ``--pmi``, ``--env``), refuses unknown ones,
  and runs ``-n N`` ranks on the local MPICH; ``bin/srun`` does the same for SLURM flags;
  ``bin/conda`` accepts ``conda activate``;
- the scheduler's variables (``PBS_JOBID``, ``PBS_NODEFILE`` listing this host,
  ``PBS_O_WORKDIR``; ``SLURM_JOB_ID``, ``SLURM_SUBMIT_DIR``, ``SLURM_JOB_NUM_NODES``)
  are set the way PBS and SLURM set them.

With ``FAKE_RECORD`` set the shims only record the rank command line and environment,
and end as a finished training does (its ``status.json``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main
from tests.helpers import REPO, hpctrain_cmd, launcher, run

pytestmark = pytest.mark.slow

TINY = ["--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16",
        "--train.batch_size=8", "--train.max_iters=6", "--train.log_interval=2",
        "--train.eval_interval=0", "--train.final_eval=false", "--train.sample_tokens=0",
        "--train.save_checkpoint=false", "--train.progress=false",
        "--train.device=cpu"]  # the GPU systems' scripts, on purpose on CPU cores here
PWNED_VALUES = ["x'; touch PWNED; '", "$(touch PWNED)", "`touch PWNED`", "a\ntouch PWNED"]
JOB_TIMEOUT = 150

PALS_MPIEXEC = r"""#!/bin/bash
# Fake HPE PALS mpiexec: Polaris/Aurora flags in, local MPICH out.
n=1
while [ $# -gt 0 ]; do
    case $1 in
        -n|--np) n=$2; shift 2 ;;
        --ppn|-ppn|--depth|-d|--cpu-bind|--env|--hostfile) shift 2 ;;
        --ppn=*|--depth=*|--cpu-bind=*|--pmi=*|--env=*) shift ;;
        -*) echo "fake mpiexec: unknown flag $1" >&2; exit 99 ;;
        *) break ;;
    esac
done
exec "$(dirname "$0")/launch-local" "$n" "$@"
"""

SRUN = r"""#!/bin/bash
# Fake srun: SLURM flags in, local MPICH out.
n=1
while [ $# -gt 0 ]; do
    case $1 in
        -n|--ntasks) n=$2; shift 2 ;;
        --ntasks=*) n=${1#--ntasks=}; shift ;;
        -n*) n=${1#-n}; shift ;;
        -N|-c|--nodes|--cpus-per-task|--ntasks-per-node|--gpus-per-node|--gpus-per-task|--cpu-bind|--gpu-bind) shift 2 ;;
        -N*|-c*|--nodes=*|--cpus-per-task=*|--ntasks-per-node=*|--gpus-per-node=*|--gpus-per-task=*|--cpu-bind=*|--gpu-bind=*|--mpi=*|--kill-on-bad-exit=*) shift ;;
        -*) echo "fake srun: unknown flag $1" >&2; exit 99 ;;
        *) break ;;
    esac
done
exec "$(dirname "$0")/launch-local" "$n" "$@"
"""

LAUNCH_LOCAL = r"""#!/bin/bash
# Run N ranks of the command on the local MPICH, or only record them (FAKE_RECORD).
n=$1; shift
printf '%s\n' "$n" > "$FAKE_LOG.ranks"
# A rank killed by a signal leaves its MPI segment behind (FAKE_SHM_LEFTOVER names it).
if [ -n "${FAKE_SHM_LEFTOVER:-}" ]; then : > "$FAKE_SHM_LEFTOVER"; fi
if [ -n "${FAKE_RECORD:-}" ]; then
    "$FAKE_PYTHON" -c 'import json, os, sys; json.dump({"argv": sys.argv[1:], "env": dict(os.environ)}, open(os.environ["FAKE_RECORD"], "w"))' "$@"
    # ...and end as a finished training does: its status.json in its out_dir.
    "$FAKE_PYTHON" -c 'import sys; from hpctrain.train.run_status import status_record, write_status; [write_status(a.split("=", 1)[1], status_record("finished", 0, 0)) for a in sys.argv[1:] if a.startswith("--train.out_dir=")]' "$@"
    exit 0
fi
# The ranks must not think they are inside a real PBS/SLURM allocation (MPICH's hydra
# would try to use it): drop those variables, launch on this host (the launcher helper
# adds what the MPI needs: `-launcher fork` for Hydra, `--oversubscribe` for Open MPI).
for v in $(compgen -e | grep -E '^(PBS_|SLURM_)'); do unset "$v"; done
MPIEXEC=$REAL_MPIEXEC exec "$FAKE_PYTHON" -m hpctrain.comm.local_mpiexec -n "$n" "$@"
"""

QSTAT = r"""#!/bin/bash
# Fake PBS `qstat -f JOB`: the job started with the script ($HPCTRAIN_JOB_START) and has
# $FAKE_WALLTIME (as if `qsub -l walltime=...` had changed it); no FAKE_WALLTIME: fail.
[ -n "${FAKE_WALLTIME:-}" ] || exit 1
echo "Job Id: $2"
echo "    Resource_List.walltime = $FAKE_WALLTIME"
echo "    stime = $(LC_ALL=C date -d "@${HPCTRAIN_JOB_START%.*}" '+%a %b %e %H:%M:%S %Y')"
"""

BASH_PROFILE = r"""
export PATH="$FAKE_BIN:$PATH"
module() {
    echo "module $*" >> "$FAKE_LOG"
    if [ "$1" = list ]; then echo "Currently Loaded Modules: 1) fake-module/1.0" >&2; fi
    return 0
}
"""


@pytest.fixture
def cluster(tmp_path):
    """A fake cluster: shims, a login-shell profile, a submit directory, a clean env."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("mpiexec", PALS_MPIEXEC), ("srun", SRUN), ("launch-local", LAUNCH_LOCAL),
                       ("qstat", QSTAT),
                       ("conda", '#!/bin/bash\necho "conda $*" >> "$FAKE_LOG"\n')):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    # A virtual environment as the job sees it: `activate` puts its bin first on PATH,
    # where python3 is this test's Python (the real venv's mpiexec must not come along).
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(
        f'export VIRTUAL_ENV="{venv}"\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\n')
    (venv / "bin" / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python3").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bash_profile").write_text(BASH_PROFILE)
    submit = tmp_path / "submit"
    submit.mkdir()
    nodefile = tmp_path / "nodefile"
    nodefile.write_text(socket.gethostname() + "\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PBS_", "SLURM_", "PMI_", "PALS_", "HYDRA_", "MPI_LOCAL",
                                "OMPI_COMM_WORLD_", "HPCTRAIN_"))}
    env.update(HOME=str(home), FAKE_BIN=str(bin_), FAKE_LOG=str(tmp_path / "fake.log"),
               FAKE_PYTHON=sys.executable, REAL_MPIEXEC=shlex.join(launcher().argv),
               OMP_NUM_THREADS="1")
    pbs = {"PBS_JOBID": "4242.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov",
           "PBS_NODEFILE": str(nodefile), "PBS_O_WORKDIR": str(submit)}
    slurm = {"SLURM_JOB_ID": "777", "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_NUM_NODES": "1",
             "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": socket.gethostname()}
    return type("Cluster", (), dict(root=tmp_path, bin=bin_, home=home, submit=submit, venv=venv,
                                    env=env, pbs=pbs, slurm=slurm, log=tmp_path / "fake.log"))


def generate(cluster, options: list[str], command: list[str], name="job.sh") -> Path:
    path = cluster.submit / name
    assert main(["jobscript", *options, "--venv", str(cluster.venv), "--output", str(path),
                 "--", *command]) == 0
    return path


def submit(cluster, script: Path, scheduler_env: dict, extra: dict | None = None):
    """Run the script the way the batch system would: executable, from the submit dir."""
    env = {**cluster.env, **scheduler_env, **(extra or {})}
    return run([str(script)], timeout=JOB_TIMEOUT, env=env, cwd=cluster.root)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_polaris_script_trains_end_to_end(cluster, dataset_path):
    command = ["train", "default", f"--data.path={dataset_path}", *TINY]
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime", "00:10:00",
                                "--queue", "debug", "--account", "TEST",
                                "--env", "OMP_NUM_THREADS=1"], command)
    p = submit(cluster, script, cluster.pbs)
    assert p.returncode == 0, p.stdout + p.stderr
    run_dir = cluster.submit / "runs" / "hpctrain"
    assert f"run directory {run_dir}" in p.stdout and "hpctrain job: finished" in p.stdout
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == [2, 4, 6]
    assert "4 rank(s)" in p.stdout  # 1 node x 4 ranks (Polaris), oversubscribed here
    # The job's records beside the outputs, in a folder of this attempt's own.
    records = run_dir / "jobs" / "4242"
    assert (records / "jobscript.sh").read_text() == script.read_text()
    assert (records / "exit_code").read_text() == "0\n"
    assert "PBS_JOBID=4242.polaris" in (records / "env.txt").read_text()
    assert "MPICH_GPU_SUPPORT_ENABLED=1" in (records / "env.txt").read_text()
    assert "fake-module/1.0" in (records / "modules.txt").read_text()
    git = (records / "git.txt").read_text().splitlines()
    assert git[0].startswith("hpctrain 0.") and str(REPO) in git[0]
    assert git[1].startswith("commit ")
    job = (records / "job.txt").read_text()
    assert "job_id 4242.polaris" in job and "ranks 4 (4 per node)" in job
    assert "(from walltime)" in job  # no qstat on this fake cluster: the script's walltime
    log = cluster.log.read_text()
    assert "module use /soft/modulefiles" in log and "module load conda" in log
    assert "conda activate" in log
    # The exact launch line, and `hpctrain launch` builds the very same one in this job.
    line = shlex.split((records / "launch.txt").read_text())
    assert line[:8] == ["mpiexec", "-n", "4", "--ppn", "4", "--depth=8", "--cpu-bind", "depth"]
    python = line[8]
    q = run([python, "-m", "hpctrain", "launch", "--dry-run", "--", *command,
             "--train.resume=auto", f"--train.out_dir={run_dir}"], timeout=60,
            env={**cluster.env, **cluster.pbs, "HPCTRAIN_SYSTEM": "polaris"}, cwd=REPO)
    assert q.returncode == 0, q.stderr
    assert shlex.split(q.stdout.strip()[2:]) == line


def test_slurm_script_trains_end_to_end(cluster, dataset_path):
    command = ["train", "default", f"--data.path={dataset_path}", *TINY]
    script = generate(cluster, ["--system", "perlmutter", "--nodes", "1", "--walltime",
                                "00:10:00", "--queue", "debug", "--account", "m0000",
                                "--ranks-per-node", "2", "--env", "OMP_NUM_THREADS=1"],
                      command, name="pm.sh")
    p = submit(cluster, script, cluster.slurm)
    assert p.returncode == 0, p.stdout + p.stderr
    run_dir = cluster.submit / "runs" / "hpctrain"
    assert [r["step"] for r in _records(run_dir) if "loss" in r] == [2, 4, 6]
    assert "2 rank(s)" in p.stdout
    records = run_dir / "jobs" / "777"
    line = shlex.split((records / "launch.txt").read_text())
    assert line[:7] == ["srun", "-n", "2", "--ntasks-per-node=2", "--cpus-per-task=64",
                        "--cpu-bind=cores", "--gpus-per-node=4"]
    assert (records / "jobscript.sh").read_text() == script.read_text()
    assert "module load pytorch" in cluster.log.read_text()
    assert "SLURM_JOB_ID=777" in (records / "env.txt").read_text()


def test_a_failing_launch_fails_the_job_loudly(cluster, dataset_path):
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime", "00:10:00",
                                "--queue", "debug", "--account", "TEST",
                                "--env", "OMP_NUM_THREADS=1"],
                      ["train", "default", f"--data.path={dataset_path}", *TINY])
    # A user edits the script and mistypes an option: the generator's check is bypassed.
    text = script.read_text()
    script.write_text(text.replace("--train.max_iters=6", "--train.max_iter=6"))
    p = submit(cluster, script, cluster.pbs)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "error: unknown option --train.max_iter; did you mean --train.max_iters?" in p.stderr
    assert "hpctrain job: FAILED: the launcher exited with status 2" in p.stderr
    assert (cluster.submit / "runs" / "hpctrain" / "jobs" / "4242" / "exit_code").read_text() \
        == "2\n"
    assert "finished" not in p.stdout


def test_missing_module_command_stops_the_job_before_launch(cluster):
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime", "00:10:00",
                                "--queue", "debug", "--account", "TEST"], ["train", "default"])
    (cluster.home / ".bash_profile").write_text('export PATH="$FAKE_BIN:$PATH"\n')
    p = submit(cluster, script, cluster.pbs)
    assert p.returncode == 1
    assert "hpctrain job: error: no module command: keep the login-shell shebang" in p.stderr
    assert not (cluster.root / "fake.log.ranks").exists()  # nothing was launched
    p = submit(cluster, script, {})  # not inside a job at all
    assert p.returncode != 0 and "submit this script with qsub" in p.stderr


def test_an_mpiexec_from_the_virtual_environment_is_refused(cluster):
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime", "00:10:00",
                                "--queue", "debug", "--account", "TEST"], ["train", "default"])
    (cluster.venv / "bin" / "mpiexec").write_text("#!/bin/sh\nexit 0\n")
    (cluster.venv / "bin" / "mpiexec").chmod(0o755)
    p = submit(cluster, script, cluster.pbs)
    assert p.returncode == 1
    assert "comes from the virtual environment" in p.stderr and "pip uninstall mpich" in p.stderr
    assert not (cluster.root / "fake.log.ranks").exists()


def test_user_values_cannot_inject_shell_code(cluster):
    overrides = [f"--train.sample_prompt={v}" for v in PWNED_VALUES] + \
        [f"--data.path={v}" for v in PWNED_VALUES]
    env = [f"NASTY{i}={v}" for i, v in enumerate(PWNED_VALUES)]
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime", "00:10:00",
                                "--queue", "debug", "--account", "TEST",
                                "--run-root", "runs/$(touch PWNED)`touch PWNED`",
                                "--env", *env], ["train", "default", *overrides])
    record = cluster.root / "record.json"
    p = submit(cluster, script, cluster.pbs, {"FAKE_RECORD": str(record)})
    assert p.returncode == 0, p.stdout + p.stderr
    assert not list(cluster.root.rglob("PWNED")) and not (REPO / "PWNED").exists()
    got = json.loads(record.read_text())
    argv = got["argv"]
    program = argv[argv.index("--", 1) + 1:]  # after the per-rank bind helper
    assert program[1:4] == ["-m", "hpctrain", "train"]
    run_dir = cluster.submit / "runs" / "$(touch PWNED)`touch PWNED`" / "hpctrain"
    assert program[5:] == [*overrides, "--train.resume=auto",  # verbatim, one each
                           f"--train.out_dir={run_dir}"]
    for i, v in enumerate(PWNED_VALUES):
        assert got["env"][f"NASTY{i}"] == v
    assert (run_dir / "jobs" / "4242" / "launch.txt").exists()


def test_array_index_reaches_the_override_and_the_run_directory(cluster):
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime", "00:10:00",
                                "--queue", "debug", "--account", "TEST", "--array", "0-3%1"],
                      ["train", "default", "--train.seed={array_index}"])
    assert "#PBS -J 0-3%1" in script.read_text() and "#PBS -r y" in script.read_text()
    record = cluster.root / "record.json"
    pbs = {**cluster.pbs, "PBS_JOBID": "4242[3].polaris-pbs-01", "PBS_ARRAY_INDEX": "3"}
    p = submit(cluster, script, pbs, {"FAKE_RECORD": str(record)})
    assert p.returncode == 0, p.stdout + p.stderr
    argv = json.loads(record.read_text())["argv"]
    run_dir = cluster.submit / "runs" / "hpctrain-3"  # per index, the same every time
    assert argv[-3:] == ["--train.seed=3", "--train.resume=auto", f"--train.out_dir={run_dir}"]
    assert (run_dir / "jobs" / "4242-3" / "job.txt").exists()


def test_launch_runs_training_locally_without_a_batch_system(cluster, dataset_path, tmp_path):
    out = tmp_path / "out"
    p = run(hpctrain_cmd("launch", "--ranks", "2", "--", "train", "default",
                         f"--data.path={dataset_path}", f"--train.out_dir={out}", *TINY),
            timeout=JOB_TIMEOUT, env={**cluster.env}, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("+ ") and shlex.split(first[2:])[1:3] == ["-n", "2"]
    assert [r["step"] for r in _records(out) if "loss" in r] == [2, 4, 6]
    bad = run(hpctrain_cmd("launch", "--ranks", "2", "--", "train", "default",
                           f"--data.path={tmp_path}/missing.h5", f"--train.out_dir={out}2"),
              timeout=JOB_TIMEOUT, env={**cluster.env}, cwd=tmp_path)
    assert bad.returncode != 0 and "does not exist" in bad.stderr


# ------------------------------------------------------------------ issue 29, items 1, 5

LONG = [a for a in TINY if not a.startswith(("--train.max_iters", "--train.save_checkpoint"))] \
    + ["--train.max_iters=100000", "--train.log_interval=20", "--train.ckpt_interval=40"]
STOPPED = re.compile(r"hpctrain job: stopped after step (\d+) of 100000 \(the time limit\), "
                     r"checkpoint saved in \S+; resubmit this script or requeue the job to "
                     r"continue \(exit status 75\)")


def test_a_job_stopped_by_its_walltime_exits_75_and_every_later_attempt_continues(
        cluster, dataset_path):
    """qsub -l walltime=00:00:20 overrides the script's 00:10:00 (the trainer asks qstat);
    the stop is exit 75 with a message that says what to do; the same job requeued (same
    id) and a new submission both continue from the checkpoint, each attempt with its own
    records; a resubmission of a finished run does nothing."""
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime",
                                "00:10:00", "--queue", "debug", "--account", "TEST",
                                "--ranks-per-node", "2", "--env", "OMP_NUM_THREADS=1"],
                      ["train", "default", f"--data.path={dataset_path}", *LONG])
    run_dir, short = cluster.submit / "runs" / "hpctrain", {"FAKE_WALLTIME": "00:00:20"}
    first = submit(cluster, script, cluster.pbs, short)
    assert first.returncode == 75, first.stdout + first.stderr
    step = int(STOPPED.search(first.stdout).group(1))
    assert "stopped by the time limit" in first.stdout
    assert "(from qstat)" in (run_dir / "jobs" / "4242" / "job.txt").read_text()
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["step"], status["reason"]) == \
        ("stopped", step, "the time limit")
    again = submit(cluster, script, cluster.pbs, short)  # PBS reran it: the same job id
    assert again.returncode == 75, again.stdout + again.stderr
    assert f"resumed from the checkpoint of step {step}" in again.stdout
    later = int(STOPPED.search(again.stdout).group(1))
    assert later > step
    script.write_text(script.read_text().replace("--train.max_iters=100000",
                                                 f"--train.max_iters={later + 4}"))
    new_job = {**cluster.pbs, "PBS_JOBID": "4343.polaris-pbs-01"}
    done = submit(cluster, script, new_job)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from the checkpoint of step {later}" in done.stdout
    assert "hpctrain job: finished" in done.stdout
    nothing = submit(cluster, script, {**cluster.pbs, "PBS_JOBID": "4444.polaris-pbs-01"})
    assert nothing.returncode == 0 and "nothing to do" in nothing.stdout
    codes = {d.name: (d / "exit_code").read_text() for d in (run_dir / "jobs").iterdir()}
    assert codes == {"4242": "75\n", "4242.2": "75\n", "4343": "0\n", "4444": "0\n"}
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"


def test_the_script_removes_what_its_ranks_left_in_dev_shm_and_nothing_else(cluster):
    """Issue 39, item 4: after the launch, the script removes the MPI segments this
    attempt's ranks left (a folder stands in for /dev/shm), not an older one."""
    shm = cluster.root / "shm"
    shm.mkdir()
    older = shm / "mpich_shm_0ld_0"
    older.write_bytes(b"\0")
    os.utime(older, (1_000_000, 1_000_000))  # another job's, from before this one
    script = generate(cluster, ["--system", "slurm", "--nodes", "1", "--walltime",
                                "00:10:00", "--ranks-per-node", "2"], ["train", "default"])
    p = submit(cluster, script, cluster.slurm,
               {"FAKE_RECORD": str(cluster.root / "record.json"), "HPCTRAIN_SHM_DIR": str(shm),
                "FAKE_SHM_LEFTOVER": str(shm / "mpich_shm_1b296e84_0")})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "removed 1 shared-memory file(s) the ranks left in" in p.stdout, p.stdout
    assert [f.name for f in shm.iterdir()] == [older.name]
    # The first attempt's script was killed as well: its leftover is still there when the
    # job is requeued (the same id); the second attempt removes it before its launch.
    stale = shm / "mpich_shm_1b296e84_0"
    stale.write_bytes(b"\0")
    again = submit(cluster, script, cluster.slurm,
                   {"FAKE_RECORD": str(cluster.root / "record.json"),
                    "HPCTRAIN_SHM_DIR": str(shm)})
    assert again.returncode == 0, again.stdout + again.stderr
    assert "removed 1 shared-memory file(s)" in again.stdout.split("\n+ ")[0], again.stdout
    assert [f.name for f in shm.iterdir()] == [older.name]


def test_a_rerun_pbs_job_keeps_each_attempts_output_in_its_records(cluster):
    """Issue 39, item 3: PBS names the job's output file by the job id, so a rerun (the
    same id) overwrites the first attempt's; each attempt's records keep their own copy
    (output.txt), while the script's stdout and stderr still go where PBS sends them."""
    script = generate(cluster, ["--system", "polaris", "--nodes", "1", "--walltime",
                                "00:10:00", "--queue", "debug", "--account", "TEST"],
                      ["train", "default"])
    record = {"FAKE_RECORD": str(cluster.root / "record.json")}
    first = submit(cluster, script, cluster.pbs, record)
    assert first.returncode == 0, first.stdout + first.stderr
    again = submit(cluster, script, cluster.pbs, record)  # PBS reran it: the same id
    assert again.returncode == 0, again.stdout + again.stderr
    jobs = cluster.submit / "runs" / "hpctrain" / "jobs"
    for attempt, p in (("4242", first), ("4242.2", again)):
        output = (jobs / attempt / "output.txt").read_text()
        assert f"run directory {cluster.submit}/runs/hpctrain" in output, attempt
        assert "hpctrain job: finished" in output
        assert output.count("hpctrain job 4242") == 1  # this attempt's lines only
        assert "hpctrain job: finished" in p.stdout  # still on the job's own stdout
    assert "output.txt" not in os.listdir(cluster.submit / "runs" / "hpctrain")
