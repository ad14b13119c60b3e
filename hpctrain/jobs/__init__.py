"""Batch jobs: job-script rendering and the in-job launcher, for the systems of
``hpctrain/systems/`` (one TOML file per machine: queues, launcher, binding).

    hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug \\
        --account PROJECT --output job.sh -- train default
    hpctrain launch --dry-run -- train default          # inside a job (or on this machine)

A request is validated in full (system, queue limits, the training command) before
anything is written, and the launch line has one builder for scripts and ``launch``.
Nothing here imports torch or mpi4py: it runs on login nodes.
Each module's part and the script's steps: docs/design/job-scripts.md.
"""
