#!/bin/bash -l
#PBS -N hpctrain
#PBS -A PROJECT
#PBS -q debug
#PBS -l select=2:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:30:00
#PBS -l filesystems=home:eagle
#PBS -j oe
#PBS -k doe

set -euo pipefail
# hpctrain job script for polaris
# ALCF Polaris: 4x A100 40GB and a 32-core EPYC 7543P per node; PBS Pro, PALS mpiexec
#
# Made by this command (edit the script freely, or change the command and run it again):
#   hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug
#     --account PROJECT --filesystems home:eagle --venv .venv -- train gpt2-124m
#     --data.path=datasets/stdlib-gpt2.h5 --parallel.micro_batches=5
# Submit it from the directory that relative paths (data, --venv, --run-root) refer to:
#   qsub SCRIPT
# Results go to runs/hpctrain/ (metrics.jsonl, checkpoints/, summary.json, status.json),
# and each attempt's records to jobs/<job id>/ there: jobscript.sh, launch.txt, env.txt, modules.txt, git.txt, job.txt, exit_code.
# Submitted again, or requeued, the job continues from the last checkpoint there.

die() { echo "hpctrain job: error: $*" >&2; exit 1; }
trap 'echo "hpctrain job: error: line $LINENO failed with status $?" >&2' ERR
# The job's start: the trainer's --train.time_limit (the walltime) counts from here.
export HPCTRAIN_JOB_START=${HPCTRAIN_JOB_START:-$(date +%s)}

# ---- the allocation -------------------------------------------------------------------
: "${PBS_JOBID:?is not set: submit this script with qsub (or run it inside qsub -I)}"
SUBMIT_DIR=${PBS_O_WORKDIR:?is not set: submit this script with qsub}
JOB_ID=$PBS_JOBID
JOB_TAG=${PBS_JOBID%%.*}
JOB_TAG=${JOB_TAG//\[/-}
JOB_TAG=${JOB_TAG//\]/}
ARRAY_INDEX=${PBS_ARRAY_INDEX:-}
NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
HOSTS=$(sort -u "$PBS_NODEFILE" | paste -sd ' ' -)
cd "$SUBMIT_DIR" || die "cannot enter the submit directory $SUBMIT_DIR"

# ---- software environment ---------------------------------------------------------------
# Module and conda scripts read unset variables, so -u is off while they run. Every step
# must succeed: a failed module load stops the job here, not halfway into training.
set +u
type module >/dev/null 2>&1 ||
    die "no module command: keep the login-shell shebang (#!/bin/bash -l) or replace the setup (--setup FILE)"
module use /soft/modulefiles || die 'setup step failed: module use /soft/modulefiles'
module load conda || die 'setup step failed: module load conda'
conda activate || die 'setup step failed: conda activate'
module load craype-accel-nvidia80 || die 'setup step failed: module load craype-accel-nvidia80'
export LD_LIBRARY_PATH="/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib/:${LD_LIBRARY_PATH}" || die 'setup step failed: export LD_LIBRARY_PATH="/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib/:${LD_LIBRARY_PATH}"'
source .venv/bin/activate || die "cannot activate the environment (--venv):" .venv/bin/activate
set -u
PYTHON=$(python3 -c 'import sys; print(sys.executable)') ||
    die "no python3 after the setup: load the module or environment that has hpctrain"
HPCTRAIN_INFO=$("$PYTHON" -c '
import hpctrain, pathlib
print(hpctrain.__version__, pathlib.Path(hpctrain.__file__).resolve().parents[1])') ||
    die "hpctrain cannot be imported by $PYTHON: pip install -e <your hpctrain checkout> in the environment (--venv)"
command -v mpiexec >/dev/null ||
    die "launcher" mpiexec "not found after the setup: load the system's MPI module"
# pip's mpich wheel puts its own mpiexec into the environment; it would hide the system's
# launcher and keep the ranks off the high-speed network.
if [ -n "${VIRTUAL_ENV:-}" ] && [[ "$(command -v mpiexec)" == "$VIRTUAL_ENV"/* ]]; then
    die "launcher" mpiexec "comes from the virtual environment $VIRTUAL_ENV, not the system: pip uninstall mpich there and build mpi4py against the system MPI (README: HPC systems)"
fi

# ---- environment of the run ------------------------------------------------------------
export HPCTRAIN_SYSTEM=polaris
export MPICH_GPU_SUPPORT_ENABLED=1
export MPICH_MAX_THREAD_SAFETY=multiple
export NCCL_NET_GDR_LEVEL=PHB
export NCCL_CROSS_NIC=1
export NCCL_COLLNET_ENABLE=1
export NCCL_NET='AWS Libfabric'
export FI_CXI_DISABLE_HOST_REGISTER=1
export FI_MR_CACHE_MONITOR=userfaultfd
export FI_CXI_DEFAULT_CQ_SIZE=131072
export OMP_NUM_THREADS=8
# Open MPI's mpirun kills the ranks 1 s after it forwards SIGTERM (the walltime, qdel,
# scancel): too soon for the stop's save. This gives them more (your own value wins);
# other MPIs ignore it (docs/design/job-scripts.md, "Open MPI").
export OMPI_MCA_odls_base_sigkill_timeout=${OMPI_MCA_odls_base_sigkill_timeout:-10}

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
# PBS writes the job's output to one file named by the job id, which a rerun (qrerun,
# -r y) of the same id overwrites: each attempt keeps a copy in its records
# (output.txt). The tees ignore the job's signals: a SIGTERM at the walltime must not
# close the script's output while the ranks save.
exec > >(trap '' TERM INT USR1; exec tee -a "$ATTEMPT_DIR/output.txt") \
    2> >(trap '' TERM INT USR1; exec tee -a "$ATTEMPT_DIR/output.txt" >&2)
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
# $0 is the copy of this script the batch system runs (what was submitted, edits included).
if [ -f "$0" ] && [ -r "$0" ]; then
    cp "$0" "$ATTEMPT_DIR/jobscript.sh"
else
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
# The job's end, from the scheduler (an `sbatch --time` or `qsub -l walltime` given at
# submission counts): training saves and stops before it, whatever the launcher does
# with the scheduler's signals (Open MPI's mpirun kills the ranks soon after SIGTERM:
# OMPI_MCA_odls_base_sigkill_timeout).
read -r HPCTRAIN_JOB_END JOB_END_FROM <<< "$("$PYTHON" -m hpctrain.jobs.job_end 1800)" || HPCTRAIN_JOB_END=
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
    mpiexec -n "${NRANKS}" --ppn 4 --depth=8 --cpu-bind depth
    "${PYTHON}" -m hpctrain.jobs.bind --device-env CUDA_VISIBLE_DEVICES --devices 4 --order reverse --
    "${PYTHON}" -m hpctrain train gpt2-124m
    --data.path=datasets/stdlib-gpt2.h5
    --parallel.micro_batches=5
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
