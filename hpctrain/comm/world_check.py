"""Does the MPI world match what the launcher started?

A launcher that cannot wire its processes into one MPI job starts N independent 1-rank
jobs instead (``srun`` without the library's MPI plugin does exactly that), and every
copy trains alone into the same run directory and reports success. The launcher still
tells each process how many it started (``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``,
``SLURM_STEP_NUM_TASKS``), so a mismatch is caught at start-up. A launcher of one MPI
that the other MPI's start-up cannot even read (Open MPI's ``mpirun``, which speaks PMIx,
starting mpi4py on MPICH) is caught before MPI starts (``check_library_matches_launcher``).
Which variable, when: docs/design/failure-handling.md ("One run per output directory").
"""

from __future__ import annotations

import os

from hpctrain.errors import UserError


class LaunchMismatch(UserError):
    """The MPI world is not the job the launcher started. Every process reports it: each
    is a job of its own, whatever rank the launcher gave it."""


class WrongLauncher(UserError):
    """The launcher belongs to another MPI than mpi4py's: found before MPI starts, in one
    launcher's job, so rank 0 (by the launcher's numbering) speaks for it."""


MPI_DOCS = "docs/systems/mpi.md"


def mpi4py_library_family() -> str | None:
    """'mpich' or 'openmpi': the MPI library mpi4py will load, found without starting MPI
    (mpi4py 4's own probe, which opens the library only); None where that cannot be told
    (an older mpi4py, or a library it cannot classify)."""
    try:
        from mpi4py import _mpiabi
        family = _mpiabi._get_mpiabi()
    except Exception:  # any failure here leaves the decision to MPI's own start-up
        return None
    return family if family in ("mpich", "openmpi") else None


def check_library_matches_launcher(env=None, family: str | None = None) -> None:
    """Raise ``WrongLauncher`` before MPI starts when Open MPI's launcher started mpi4py
    on MPICH (MPICH's start-up would abort with 'unsupported PMI version PMIx'), or
    MPICH's Hydra started it on Open MPI (each rank a job of its own). ``family``: the
    library's, else ``mpi4py_library_family()``."""
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env:
        launcher = "openmpi"
    elif "PMI_SIZE" in env and ("PMI_FD" in env or "PMI_PORT" in env) \
            and not any(k.startswith(("PMIX_", "SLURM_STEP", "PALS_")) for k in env):
        launcher = "mpich"  # Hydra's simple PMI (srun and PALS are left to their plugins)
    else:
        return
    family = family or mpi4py_library_family()
    if family is None or family == launcher:
        return
    names = {"openmpi": "Open MPI", "mpich": "MPICH"}
    use = {"openmpi": "Open MPI's mpirun",
           "mpich": "MPICH's mpiexec (the mpich wheel's: .venv/bin/mpiexec)"}
    raise WrongLauncher(
        f"{names[launcher]}'s launcher started this process, but mpi4py runs on "
        f"{names[family]}: launch with {use[family]}, or build mpi4py against "
        f"{names[launcher]} (make install MPI_PACKAGES=\"--no-binary mpi4py mpi4py\"; "
        f"{MPI_DOCS})")


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
