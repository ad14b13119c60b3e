"""Make any failure on any rank end the whole job, loudly and quickly.

Without this, an exception on one rank leaves the others blocked in their next
collective until the batch system kills the allocation. The hook prints the failing
rank's message or traceback, then calls ``MPI.COMM_WORLD.Abort`` so ``mpiexec`` stops
every rank and exits non-zero.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from hpctrain.errors import EXIT_USER_ERROR, UserError

# When every rank hits the same user error (a bad option), rank 0 prints it and aborts;
# the others wait this long first so that the user reads the message once.
_NON_ROOT_GRACE_S = 1.0
# Time for the launcher to forward what a rank printed before its abort kills the job.
_STDIO_DRAIN_S = 0.25


def env_rank() -> int:
    """This process's rank as the launcher announces it, readable before MPI starts."""
    for name in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID",
                 "SLURM_PROCID"):
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0


def report(exc: BaseException, rank: int, size: int) -> int:
    """Print ``exc`` the way a user should see it; return the exit code to use."""
    prefix = f"[rank {rank}/{size}] " if size > 1 else ""
    if isinstance(exc, UserError):
        print(f"{prefix}error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).rstrip("\n").replace("\n", "\n" + prefix)
    print(f"{prefix}{text}", file=sys.stderr, flush=True)
    return 1


def install_abort_handler(comm) -> None:
    """Route uncaught exceptions (main thread and helper threads) to ``abort_job``."""

    def on_exception(exc_type, exc, tb):
        if exc.__traceback__ is None:
            exc = exc.with_traceback(tb)
        abort_job(comm, exc)

    def on_thread_exception(args):
        abort_job(comm, args.exc_value)

    sys.excepthook = on_exception
    threading.excepthook = on_thread_exception


def abort_job(comm, exc: BaseException) -> None:
    rank, size = comm.Get_rank(), comm.Get_size()
    if size > 1 and rank != 0 and isinstance(exc, UserError):
        time.sleep(_NON_ROOT_GRACE_S)
    code = report(exc, rank, size)
    sys.stdout.flush()
    sys.stderr.flush()
    if size == 1:
        os._exit(code)
    # mpiexec's proxy forwards our stderr and handles the abort request on different
    # channels; abort at once and it may kill the job before the message above is
    # forwarded (seen with MPICH: the error vanished in 1 of 16 runs).
    time.sleep(_STDIO_DRAIN_S)
    comm.Abort(code)
    # MPICH's MPI_Abort can return to the caller; never let a rank carry on after it.
    os._exit(code)
