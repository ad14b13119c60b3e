#!/bin/bash
# Regenerates every example job script in this folder from the commands below.
#   bash jobscripts/generate.sh        (from anywhere; uses .venv/bin/python or $PYTHON)
# tests/test_jobs_cli.py checks that each example is byte-for-byte what its command makes,
# so edit a command here (not the script) and run this file again.
set -euo pipefail
cd "$(dirname "$0")/.."
hpctrain() { "${PYTHON:-.venv/bin/python}" -m hpctrain "$@"; }

# GPT-2 124M (recipe gpt2-124m) on the ALCF GPU systems, 12 rows per micro-batch:
# Polaris 2 nodes x 4 A100 (480 = 8 x 5 x 12), Aurora 1 node x 12 tiles (576 = 12 x 4 x 12).
hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug \
    --account PROJECT --filesystems home:eagle --venv .venv \
    --output jobscripts/polaris-debug.sh \
    -- train gpt2-124m --data.path=datasets/stdlib-gpt2.h5 --parallel.micro_batches=5

hpctrain jobscript --system aurora --nodes 1 --walltime 00:30:00 --queue debug \
    --account PROJECT --filesystems home:flare --venv .venv \
    --output jobscripts/aurora-debug.sh \
    -- train gpt2-124m --data.path=datasets/stdlib-gpt2.h5 --train.batch_size=576 \
    --parallel.micro_batches=4

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
