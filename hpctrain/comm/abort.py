"""Make any failure on any rank end the whole job, loudly, quickly and with a true status.

Without this, an exception on one rank leaves the others blocked in their next
collective until the batch system kills the allocation. The hook prints the failing
rank's message or traceback, then calls ``MPI.COMM_WORLD.Abort``. A user's error
(``UserError``, status 2) first waits up to ``AGREE_S`` for every rank to report one too
(on ``JobExit.errors``, a communicator of its own): then rank 0 prints once and every
rank exits 2 by itself, because under ``srun`` an abort is recorded as 137 whatever code
was asked for. Anything else, a traceback or an error in a helper thread, aborts at once.
Why, per launcher: docs/design/failure-handling.md ("Errors a user can fix").
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

from hpctrain.errors import EXIT_USER_ERROR, UserError

EXIT_INTERRUPTED = 130
"""128 + SIGINT (the shell's convention): Ctrl-C ended the run at once, a second one
during a run, or one before the trainer set up its handler."""
FINALIZE_S = 10.0
"""The longest an agreed exit waits in ``MPI_Finalize`` before leaving without it."""
AGREE_S = 5.0
"""How long a rank with a user error waits for the others to report one as well."""
# When every rank hits the same user error without agreeing (no error communicator),
# rank 0 prints it and aborts; the others wait this long first so that the user reads
# the message once.
_NON_ROOT_GRACE_S = 1.0
# Time for the launcher to forward what a rank printed before its abort kills the job.
_STDIO_DRAIN_S = 0.25
_POLL_S = 0.01


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
    if isinstance(exc, KeyboardInterrupt):
        print(f"{prefix}interrupted (Ctrl-C): stopped at once, without saving",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    text = "".join(lines).rstrip("\n").replace("\n", "\n" + prefix)
    print(f"{prefix}{text}", file=sys.stderr, flush=True)
    return 1


class JobExit:
    """How this process ends the job when something fails (``fail``), over ``comm``.
    ``errors``: a communicator of the same ranks used only to agree on user errors
    (None: no agreement, every failure aborts)."""

    def __init__(self, comm, errors=None):
        self.comm, self.errors = comm, errors

    def on_exception(self, exc_type, exc, tb) -> None:
        if exc.__traceback__ is None:
            exc = exc.with_traceback(tb)
        self.fail(exc)

    def on_thread_exception(self, args) -> None:
        # Another thread's error is its own: the other ranks will not report it.
        self.fail(args.exc_value, agree=False)

    def fail(self, exc: BaseException, agree: bool = True) -> None:
        """End this process, and with it the job; never returns."""
        rank, size = self.comm.Get_rank(), self.comm.Get_size()
        if size == 1:
            os._exit(report(exc, rank, size))
        if agree and isinstance(exc, UserError) and self.errors is not None and self._agree():
            if rank == 0:  # speaks for the job (the others' may add a rank's detail)
                print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # No rank leaves before rank 0 has written its message: the launcher ends the
            # job when the first rank exits, and could take rank 0 down before it prints.
            self._agree()
            exit_releasing_mpi(EXIT_USER_ERROR)
        self._abort(exc, rank, size)

    def _agree(self) -> bool:
        """True once every rank has failed with a user error; False when some rank did not
        within ``AGREE_S``."""
        request = self.errors.Ibarrier()
        deadline = time.monotonic() + AGREE_S
        while not request.Test():
            if time.monotonic() > deadline:
                return False  # left pending: the abort ends it
            time.sleep(_POLL_S)
        return True

    def _abort(self, exc: BaseException, rank: int, size: int) -> None:
        if rank != 0 and isinstance(exc, UserError):
            time.sleep(_NON_ROOT_GRACE_S)
        code = report(exc, rank, size)
        sys.stdout.flush()
        sys.stderr.flush()
        # mpiexec's proxy forwards our stderr and handles the abort request on different
        # channels; abort at once and it may kill the job before the message above is
        # forwarded (seen with MPICH: the error vanished in 1 of 16 runs).
        time.sleep(_STDIO_DRAIN_S)
        self.comm.Abort(code)
        # MPICH's MPI_Abort can return to the caller; never let a rank carry on after it.
        os._exit(code)


def exit_releasing_mpi(code: int) -> None:
    """End the process with ``code`` after ``MPI_Finalize``, which removes the shared-memory
    segments MPI made in /dev/shm (``os._exit`` alone leaves them: on shared nodes they
    pile up until later MPI starts fail). Every rank calls it together (they agreed);
    should finalize hang, a timer ends the process after ``FINALIZE_S`` all the same."""
    timer = threading.Timer(FINALIZE_S, os._exit, args=(code,))
    timer.daemon = True
    timer.start()
    try:
        from hpctrain.comm.mpi import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    except Exception:  # noqa: BLE001 - the exit status is what matters now
        pass
    os._exit(code)


def install_abort_handler(comm) -> JobExit:
    """Route uncaught exceptions (main thread and helper threads) to a ``JobExit`` over
    ``comm``, and unlink MPI's shared-memory segment names now that every rank has
    joined, so that no exit, even an abort or a kill, leaves them in /dev/shm
    (``shm_segments.py``). Collective: it duplicates ``comm`` for the agreement on user
    errors."""
    from hpctrain.comm.shm_segments import unlink_segment_names

    unlink_segment_names(comm)
    handler = JobExit(comm, comm.Dup() if comm.Get_size() > 1 else None)
    sys.excepthook = handler.on_exception
    threading.excepthook = handler.on_thread_exception
    return handler


def installed_handler(comm) -> JobExit | None:
    """The ``JobExit`` that ``install_abort_handler`` put in place for ``comm``, if any."""
    handler = getattr(sys.excepthook, "__self__", None)
    return handler if isinstance(handler, JobExit) and handler.comm is comm else None


def abort_job(comm, exc: BaseException) -> None:
    """End the job for ``exc`` (the installed handler's way, agreement included; an
    abort where none is installed). Never returns."""
    (installed_handler(comm) or JobExit(comm)).fail(exc)
