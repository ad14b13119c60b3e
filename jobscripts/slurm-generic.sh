#!/bin/bash -l
#SBATCH --job-name=hpctrain
#SBATCH --account=PROJECT
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=USR1@120

set -euo pipefail
# hpctrain job script for slurm
# generic SLURM cluster: srun -n N --ntasks-per-node=P; set --ranks-per-node, --queue
#
# Made by this command (edit the script freely, or change the command and run it again):
#   hpctrain jobscript --system slurm --nodes 2 --walltime 01:00:00 --queue gpu
#     --account PROJECT --ranks-per-node 4 --venv .venv -- train default
#     --data.path=datasets/stdlib-char.h5
# Submit it from the directory that relative paths (data, --venv, --run-root) refer to:
#   sbatch SCRIPT
# Results go to runs/hpctrain/ (metrics.jsonl, checkpoints/, summary.json, status.json),
# and each attempt's records to jobs/<job id>/ there: jobscript.sh, launch.txt, env.txt, modules.txt, git.txt, job.txt, exit_code.
# Submitted again, or requeued, the job continues from the last checkpoint there.

die() { echo "hpctrain job: error: $*" >&2; exit 1; }
trap 'echo "hpctrain job: error: line $LINENO failed with status $?" >&2' ERR
# The job's start: the trainer's --train.time_limit (the walltime) counts from here.
export HPCTRAIN_JOB_START=${HPCTRAIN_JOB_START:-$(date +%s)}

# ---- the allocation -------------------------------------------------------------------
: "${SLURM_JOB_ID:?is not set: submit this script with sbatch (or run it inside salloc)}"
SUBMIT_DIR=${SLURM_SUBMIT_DIR:-$PWD}
JOB_ID=$SLURM_JOB_ID
if [ -n "${SLURM_ARRAY_TASK_ID:-}" ]; then
    JOB_TAG=${SLURM_ARRAY_JOB_ID}-${SLURM_ARRAY_TASK_ID}
else
    JOB_TAG=$SLURM_JOB_ID
fi
ARRAY_INDEX=${SLURM_ARRAY_TASK_ID:-}
NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:?is not set: run this script under sbatch}}
HOSTS=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd ' ' -) ||
    HOSTS=${SLURM_JOB_NODELIST:-unknown}
cd "$SUBMIT_DIR" || die "cannot enter the submit directory $SUBMIT_DIR"

# ---- software environment ---------------------------------------------------------------
# Module and conda scripts read unset variables, so -u is off while they run. Every step
# must succeed: a failed module load stops the job here, not halfway into training.
set +u
source .venv/bin/activate || die "cannot activate the environment (--venv):" .venv/bin/activate
set -u
PYTHON=$(python3 -c 'import sys; print(sys.executable)') ||
    die "no python3 after the setup: load the module or environment that has hpctrain"
HPCTRAIN_INFO=$("$PYTHON" -c '
import hpctrain, pathlib
print(hpctrain.__version__, pathlib.Path(hpctrain.__file__).resolve().parents[1])') ||
    die "hpctrain cannot be imported by $PYTHON: pip install -e <your hpctrain checkout> in the environment (--venv)"
command -v srun >/dev/null ||
    die "launcher" srun "not found after the setup: load the system's MPI module"

# ---- environment of the run ------------------------------------------------------------
export HPCTRAIN_SYSTEM=slurm

# ---- run directory: training outputs, and this attempt's records -----------------------
# The run directory is the same for every requeue and resubmission of this script (it is
# named by the job, not the job id), and training resumes from its last checkpoint
# (--train.resume=auto). Each attempt keeps its records in jobs/<job id>/ (a requeue
# under the same id: jobs/<job id>.2/, ...), so none overwrites another's.
RUN_ROOT=runs
case $RUN_ROOT in /*) ;; *) RUN_ROOT=$SUBMIT_DIR/$RUN_ROOT ;; esac
RUN_DIR="${RUN_ROOT}"/hpctrain
case $RUN_DIR in /*) ;; *) RUN_DIR=$SUBMIT_DIR/$RUN_DIR ;; esac
mkdir -p "$RUN_DIR/jobs" || die "cannot create the run directory $RUN_DIR"
ATTEMPT_DIR=$RUN_DIR/jobs/$JOB_TAG
ATTEMPT=1
until mkdir "$ATTEMPT_DIR" 2>/dev/null; do
    [ -e "$ATTEMPT_DIR" ] || die "cannot create $ATTEMPT_DIR"
    ATTEMPT=$((ATTEMPT + 1))
    ATTEMPT_DIR=$RUN_DIR/jobs/$JOB_TAG.$ATTEMPT
done
# Compute nodes have no internet, and their /tmp is gone after the job: tokenizer files
# are read from caches on the shared file system (fill them once on a login node, e.g.
# TIKTOKEN_CACHE_DIR=~/.cache/tiktoken python -c "import tiktoken; tiktoken.get_encoding('gpt2')"),
# the Hugging Face hub is not asked, and torch.compile's kernels are kept in the run
# directory, so a requeued attempt does not compile again. Values set before win.
export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-$HOME/.cache/tiktoken}
export HF_HOME=${HF_HOME:-$HOME/.cache/huggingface}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$RUN_DIR/cache/torchinductor}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$RUN_DIR/cache/triton}
# $0 is SLURM's copy of the submitted script; scontrol can write it out as well.
if [ -f "$0" ] && [ -r "$0" ]; then
    cp "$0" "$ATTEMPT_DIR/jobscript.sh"
elif ! scontrol write batch_script "$SLURM_JOB_ID" "$ATTEMPT_DIR/jobscript.sh" >/dev/null 2>&1; then
    echo "hpctrain job: warning: cannot read $0; no copy of the job script saved" >&2
fi
# The environment, owner-readable only, secrets' values hidden (jobs/env_record.py).
"$PYTHON" -m hpctrain.jobs.env_record "$ATTEMPT_DIR/env.txt" || true
set +u
module list > "$ATTEMPT_DIR/modules.txt" 2>&1 || echo "(no module command)" > "$ATTEMPT_DIR/modules.txt"
set -u
read -r HPCTRAIN_VERSION HPCTRAIN_SRC <<< "$HPCTRAIN_INFO"
{
    echo "hpctrain $HPCTRAIN_VERSION from $HPCTRAIN_SRC"
    if SHA=$(git -C "$HPCTRAIN_SRC" rev-parse HEAD 2>/dev/null); then
        echo "commit $SHA"
        git -C "$HPCTRAIN_SRC" status --short --untracked-files=no 2>/dev/null || true
    else
        echo "commit unknown (not a git checkout)"
    fi
} > "$ATTEMPT_DIR/git.txt"

# ---- launch ---------------------------------------------------------------------------
RANKS_PER_NODE=4
NRANKS=$((NNODES * RANKS_PER_NODE))
# srun's --mpi= plugin for the MPI library mpi4py loads (pmi2 for MPICH, pmix for Open MPI,
# among those `srun --mpi=list` offers): `hpctrain jobscript --srun-mpi NAME` fixes it.
SRUN_MPI=$("$PYTHON" -m hpctrain.jobs.srun_mpi) ||
    die "cannot choose srun's MPI plugin; regenerate the script with --srun-mpi pmi2 (or pmix)"
# The job's end, from the scheduler (an `sbatch --time` or `qsub -l walltime` given at
# submission counts): training saves and stops before it, whatever the launcher does
# with the scheduler's signals (Open MPI's mpirun kills the ranks soon after SIGTERM:
# OMPI_MCA_odls_base_sigkill_timeout).
read -r HPCTRAIN_JOB_END JOB_END_FROM <<< "$("$PYTHON" -m hpctrain.jobs.job_end 3600)" || HPCTRAIN_JOB_END=
export HPCTRAIN_JOB_END
{
    echo "job_id $JOB_ID"
    echo "attempt $ATTEMPT"
    echo "system $HPCTRAIN_SYSTEM"
    echo "nodes $NNODES"
    echo "hosts $HOSTS"
    echo "ranks $NRANKS ($RANKS_PER_NODE per node)"
    echo "started $(date -Is)"
    if [ -n "$HPCTRAIN_JOB_END" ]; then
        echo "ends $(date -Is -d "@$HPCTRAIN_JOB_END") (from $JOB_END_FROM)"
    fi
} > "$ATTEMPT_DIR/job.txt"
# What the ranks of an earlier attempt of this job id left in /dev/shm when its script was
# killed too (the clean-up below never ran): MPICH would find its stale segment under the
# same name (jobs/shm_leftovers.py).
if [ "$ATTEMPT" -gt 1 ] && [ -f "$RUN_DIR/jobs/$JOB_TAG/job.txt" ]; then
    "$PYTHON" -m hpctrain.jobs.shm_leftovers "$RUN_DIR/jobs/$JOB_TAG/job.txt" || true
fi
LAUNCH=(
    srun --mpi="${SRUN_MPI}" -n "${NRANKS}" --ntasks-per-node=4 --kill-on-bad-exit=1
    "${PYTHON}" -m hpctrain train default
    --data.path=datasets/stdlib-char.h5
    --train.resume=auto
    --train.out_dir="${RUN_DIR}"
)
{ printf '%q' "${LAUNCH[0]}"; printf ' %q' "${LAUNCH[@]:1}"; echo; } > "$ATTEMPT_DIR/launch.txt"
echo "hpctrain job $JOB_ID: $NNODES node(s) x $RANKS_PER_NODE rank(s), run directory $RUN_DIR"
echo "+ $(< "$ATTEMPT_DIR/launch.txt")"
# At the time limit (or on qdel/scancel) the batch system sends SIGTERM to every process
# of the job, this shell included, and SIGKILL some seconds later. Untrapped, SIGTERM would
# end this shell at once and leave no exit_code. So the launcher runs in the background,
# the trap records the signal in exit_code right away (143 = 128 + SIGTERM, kept if SIGKILL
# follows), and the shell goes on waiting while the ranks save a checkpoint and exit; their
# status then replaces the record. A SIGUSR1 meant for the ranks (sbatch --signal=B:USR1)
# is passed on to the launcher, which forwards it. Ctrl-C (SIGINT, when this script runs
# in a terminal) reaches the launcher from the terminal itself: it is only recorded here.
on_signal() {
    echo "hpctrain job: received SIG$1 ($(date -Is)); waiting for the ranks to save and stop" >&2
    echo "$2" > "$ATTEMPT_DIR/exit_code"
    if [ "$1" = USR1 ]; then kill -USR1 "${LAUNCHER_PID:-}" 2>/dev/null || true; fi
    INTERRUPTED=1
}
trap 'on_signal TERM 143' TERM
trap 'on_signal USR1 138' USR1
trap 'on_signal INT 130' INT
"${LAUNCH[@]}" &
LAUNCHER_PID=$!
while :; do
    INTERRUPTED=
    rc=0
    wait "$LAUNCHER_PID" || rc=$?
    [ -n "$INTERRUPTED" ] || break  # a trap ended the wait, not the launcher: wait again
done
echo "$rc" > "$ATTEMPT_DIR/exit_code"
# The shared-memory files this attempt's ranks left in /dev/shm on this node (a rank
# killed by a signal never removes its own): only files made since the launch, by this
# user, that no process has open or mapped (jobs/shm_leftovers.py).
"$PYTHON" -m hpctrain.jobs.shm_leftovers "$ATTEMPT_DIR/job.txt" || true
# How training ended (status.json, written by rank 0 of this attempt: the trainer clears it
# at start): finished, or stopped early with a checkpoint. A stopped run exits
# 75, so that the scheduler and the next job tell it from a finished one
# (hpctrain jobscript --stop-exit-code), also when the launcher's own status is not 0
# (Open MPI's mpirun reports 1 for ranks that saved and exited 0 after its SIGTERM).
STATUS=unknown
if [ "$RUN_DIR/status.json" -nt "$ATTEMPT_DIR/job.txt" ]; then  # written by this attempt
    read -r STATUS STEP MAX_ITERS REASON <<< "$("$PYTHON" -m hpctrain.train.run_status "$RUN_DIR")" || STATUS=unknown
fi
if [ "$rc" -ne 0 ] && [ "$STATUS" != stopped ]; then
    echo "hpctrain job: FAILED: the launcher exited with status $rc; the error is above, the records are in $ATTEMPT_DIR" >&2
    exit "$rc"
fi
if [ "$STATUS" = stopped ]; then
    echo "75" > "$ATTEMPT_DIR/exit_code"
    if [ "$STEP" = 0 ]; then  # a stop during set-up, before any step: nothing saved
        echo "hpctrain job: stopped before the first step (${REASON:-a signal}), nothing trained yet; resubmit this script or requeue the job to start (exit status 75)"
    else
        echo "hpctrain job: stopped after step $STEP of $MAX_ITERS (${REASON:-a signal}), checkpoint saved in $RUN_DIR; resubmit this script or requeue the job to continue (exit status 75)"
    fi
    exit 75
fi
if [ "$STATUS" != finished ]; then
    # The launcher's 0 says nothing here: Hydra exits 0 or 255 after its second-Ctrl-C
    # cleanup kills the ranks, and a killed rank 0 writes no status.json.
    echo 1 > "$ATTEMPT_DIR/exit_code"
    echo "hpctrain job: FAILED: the launcher exited 0 but the run did not record that it finished (status: $STATUS); the log above says where it ended, the records are in $ATTEMPT_DIR" >&2
    exit 1
fi
echo "hpctrain job: finished; results in $RUN_DIR (metrics.jsonl, summary.json)"
