#!/bin/bash
# Regenerates every example job script in this folder from the commands below.
#   bash jobscripts/generate.sh        (from anywhere; uses .venv/bin/python or $PYTHON)
# tests/test_jobs.py checks that each example is byte-for-byte what its command makes,
# so edit a command here (not the script) and run this file again.
set -euo pipefail
cd "$(dirname "$0")/.."
hpctrain() { "${PYTHON:-.venv/bin/python}" -m hpctrain "$@"; }

hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug \
    --account PROJECT --filesystems home:eagle --venv .venv \
    --output jobscripts/polaris-debug.sh \
    -- train default --data.path=datasets/stdlib-char.h5

hpctrain jobscript --system aurora --nodes 16 --walltime 01:00:00 --queue debug-scaling \
    --account PROJECT --filesystems home:flare --venv .venv \
    --output jobscripts/aurora-debug-scaling.sh \
    -- train default --data.path=datasets/stdlib-char.h5 --train.batch_size=192

hpctrain jobscript --system perlmutter --nodes 2 --walltime 00:30:00 --queue debug \
    --account PROJECT --venv .venv \
    --output jobscripts/perlmutter-debug.sh \
    -- train default --data.path=datasets/stdlib-char.h5

hpctrain jobscript --system frontier --nodes 2 --walltime 01:00:00 --queue batch \
    --account PROJECT --venv .venv \
    --output jobscripts/frontier-batch.sh \
    -- train default --data.path=datasets/stdlib-char.h5

hpctrain jobscript --system slurm --nodes 2 --ranks-per-node 4 --walltime 01:00:00 \
    --queue gpu --account PROJECT --venv .venv \
    --output jobscripts/slurm-generic.sh \
    -- train default --data.path=datasets/stdlib-char.h5
