"""The world of a command that runs on every rank of an ``mpiexec`` (train, doctor)."""

from __future__ import annotations

import os


def job_world(*, timeout: float, device: str, gpu_aware: str, collectives: str = "mpi"):
    """Abort every rank when one fails, check the launcher wired one job (not N one-rank
    jobs), and build the ``World`` over ``COMM_WORLD`` under the job's system
    (``HPCTRAIN_SYSTEM``). Collective."""
    from hpctrain.comm.abort import install_abort_handler
    from hpctrain.comm.mpi import MPI  # checks the launcher is this MPI's before it starts
    from hpctrain.comm.world import World
    from hpctrain.comm.world_check import check_world_size

    install_abort_handler(MPI.COMM_WORLD)
    check_world_size(MPI.COMM_WORLD.Get_size())
    return World.create(MPI.COMM_WORLD, timeout=timeout, device=device, gpu_aware=gpu_aware,
                        collectives=collectives, system=os.environ.get("HPCTRAIN_SYSTEM"))


def job_system():
    """The system the job runs under (``HPCTRAIN_SYSTEM``), or None."""
    from hpctrain.systems.registry import load_system

    name = os.environ.get("HPCTRAIN_SYSTEM")
    return load_system(name) if name else None
