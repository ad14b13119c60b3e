"""Batch jobs: job-script rendering and the in-job launcher, for the systems of
``hpctrain/systems/`` (one TOML file per machine: queues, launcher, binding).

    hpctrain jobscript --system polaris --nodes 2 --walltime 00:30:00 --queue debug \\
        --account PROJECT --output job.sh -- train default
    hpctrain launch --dry-run -- train default          # inside a job (or on this machine)

- ``job_system.py``  a system's ``[batch]`` and ``[launch]`` checked for jobs, and
                     ``--list-systems``
- ``validate.py``    pure checks with messages that name the fix
- ``command.py``     the hpctrain command after ``--``, validated like ``hpctrain train``
- ``spec.py``        a whole request, validated before anything is written
- ``shell.py``       quoting: a user's string is always one bash word, never code
- ``launch_line.py`` the launch line (one builder for scripts and ``hpctrain launch``)
- ``render.py``      Jinja2 templates (``templates/``) -> script text, atomic writes
- ``bind.py``        per-rank device selection and profiler, run before MPI starts
- ``srun_mpi.py``    which ``srun --mpi=`` plugin the job's MPI library needs

Nothing here imports torch or mpi4py: it runs on login nodes.
"""
