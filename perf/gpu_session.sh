#!/usr/bin/env bash
# One call on a GPU machine lent for minutes, without network: the GPU environment built
# from .gpu-wheels/ (`make gpu-wheels`, made where pip reaches PyPI and copied beside the
# checkout) on the machine's own python3, torch and MPI; then `make gpu-check` inside the
# time given (what the environment took is taken off the check's budget), or `make test`.
# The result JSON and the logs are copied into OUT whatever happens, a timeout included.
#
#   perf/gpu_session.sh OUT SECONDS check [perf/gpu_check.py options, e.g. --only fp8]
#   perf/gpu_session.sh OUT SECONDS test
#   DRY=1 perf/gpu_session.sh /tmp/out 400 check     # the fake device, on any machine
set -u -o pipefail
if [ $# -lt 3 ] || { [ "$3" != check ] && [ "$3" != test ]; }; then
  echo "usage: $0 OUT SECONDS check|test [gpu_check.py options]" >&2
  exit 2
fi
out=$1 seconds=$2 what=$3
shift 3
start=$(date +%s)
mkdir -p "$out"
left() { echo $(( seconds - ($(date +%s) - start) )); }
save() {
  cp perf/results/gpu-*.json perf/results/quick/gpu-*.json "$out"/ 2>/dev/null
  for leg in unit mpi2 mpi4; do cp "test-reports/$leg.log" "$out/test-$leg.log" 2>/dev/null; done
  return 0
}
trap save EXIT

export PYTHONUNBUFFERED=1
offline=()
if [ -d .gpu-wheels ] && [ -z "${DRY:-}" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.gpu-wheels
  offline=(TORCH= TORCH_GPU= VENV_FLAGS=--system-site-packages MPI_PACKAGES=)
fi

if [ "$what" = test ]; then
  timeout "$(left)" make test "${offline[@]}" TIME_LIMIT=$(( $(left) - 20 )) 2>&1 \
    | tee "$out/make-test.log"
  exit
fi
if [ -n "${DRY:-}" ]; then
  timeout "$(left)" make install "${offline[@]}" >"$out/gpu-env.log" 2>&1
else
  timeout "$(left)" make gpu-env "${offline[@]}" >"$out/gpu-env.log" 2>&1
fi || { echo "the GPU environment failed: $out/gpu-env.log" >&2; tail -20 "$out/gpu-env.log" >&2; exit 1; }
budget=$(( $(left) - 30 ))  # time to write and copy the results after the check
echo "environment ready in $(( $(date +%s) - start )) s; the check gets $budget s"
timeout "$(( $(left) - 5 ))" make gpu-check "${offline[@]}" DRY="${DRY:-}" \
  GPU_CHECK_ARGS="--budget $budget $*" 2>&1 | tee "$out/gpu-check.log"
