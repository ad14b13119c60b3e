"""Does the MPI world match what the launcher started?

A launcher that cannot wire its processes into one MPI job starts N independent 1-rank
jobs instead (``srun`` without the library's MPI plugin does exactly that), and every
copy trains alone into the same run directory and reports success. The launcher still
tells each process how many it started (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``,
``SLURM_STEP_NUM_TASKS``), so a mismatch is caught at start-up.
Which variable, when: docs/design/failure-handling.md ("One run per output directory").
"""

from __future__ import annotations

import os

from hpctrain.errors import UserError


class LaunchMismatch(UserError):
    """The MPI world is not the job the launcher started. Every process reports it: each
    is a job of its own, whatever rank the launcher gave it."""


def declared_size(env=None) -> tuple[int, str] | None:
    """(size, variable) the launcher declared for this process's world, if any."""
    env = os.environ if env is None else env
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = env.get(var, "")
        if value.isdigit():
            return int(value), var
    return None


def check_world_size(world_size: int, env=None) -> None:
    """Raise ``LaunchMismatch`` naming the likely fix when ``world_size`` is not what the
    launcher started (see the module docstring for what is compared)."""
    env = os.environ if env is None else env
    declared = declared_size(env)
    if declared is not None and declared[0] != world_size:
        size, var = declared
        raise LaunchMismatch(
            f"the launcher started {size} rank(s) ({var}={size}) but MPI joined "
            f"{world_size}: mpi4py is built against another MPI than the launcher's "
            "mpiexec; use the mpiexec of the MPI that mpi4py was built with")
    tasks = env.get("SLURM_STEP_NUM_TASKS", "")
    if world_size == 1 and "SLURM_PROCID" in env and tasks.isdigit() and int(tasks) > 1:
        raise LaunchMismatch(
            f"srun started {tasks} tasks but each is a 1-rank MPI job (they would train "
            "independently into the same files): srun needs the MPI plugin of your MPI, "
            "e.g. `srun --mpi=pmix` or `srun --mpi=pmi2` (see `srun --mpi=list`), or "
            "launch with mpiexec")
