"""Stopping on the scheduler's signal, on Ctrl-C, or at the trainer's own deadline
(``deadline.py``): save a checkpoint and exit cleanly.

The handler only records the signal (``SignalFlag``), for the whole life of a run, and
nothing is interrupted half-way; a second Ctrl-C means "now" (``KeyboardInterrupt``, no
save). Ranks may see a signal at different steps, so they agree before acting
(``StopAgreement``: a nonblocking, persistent where MPI-4 allows, allreduce (MAX) of
each rank's reason, read at the next check), and all stop after the same step, save the
same checkpoint, name the same cause and exit 0. Evaluations check before each forward
pass (``poll``), and right after a checkpoint (``now``); the sample checks ``local_stop``
per token.
Where the ranks agree, and why: docs/design/failure-handling.md
("The walltime, signals and Ctrl-C: stop, save, exit 0").
"""

from __future__ import annotations

import signal
import threading

import numpy as np

from hpctrain.comm.mpi import MPI
from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.comm.features import persistent_collectives
from hpctrain.comm.resources import MPIResources
from hpctrain.comm.watchdog import wait_all

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
TIME_LIMIT = "the time limit"
NO_STOP, DEADLINE_CODE, SIGNAL_BASE = 0, 1, 2
"""Why a rank would stop, reduced with MAX: no reason, the deadline passed, or SIGNAL_BASE
plus a signal's number (a signal a rank received outranks another rank's deadline)."""


class SignalFlag:
    """Records SIGTERM / SIGUSR1 / SIGINT instead of dying; ``restore()`` puts back the
    previous handlers. Installed only from the main thread (Python's rule for handlers)."""

    def __init__(self):
        self.received: int | None = None
        self.reason: str | None = None
        """Why the run stops when no signal came (the time limit, ``trip``)."""
        self.detail: str = ""
        """What the log adds to ``reason`` (the time left and the margin)."""
        self._previous: dict = {}

    def install(self) -> "SignalFlag":
        if threading.current_thread() is threading.main_thread() and not self._previous:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self, ignore: bool = False) -> None:
        """Put back the previous handlers; ``ignore``: ignore these signals instead, for
        the rest of the process (its exit, where MPI's finalize may wait for slower ranks:
        a walltime signal then must not kill a rank that has saved and finished)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ignore else handler)
        self._previous = {}

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            # The second Ctrl-C: the user does not want to wait for the save. A third
            # one meets Python's own handler again.
            signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT,
                                                            signal.default_int_handler))
            raise KeyboardInterrupt("interrupted twice (Ctrl-C)")
        if self.received is None:
            self.received = signum

    def trip(self, reason: str, detail: str = "") -> None:
        """Stop as if a signal had come, for ``reason`` (e.g. the time limit)."""
        if not self.stopping:
            self.reason, self.detail = reason, detail

    @property
    def stopping(self) -> bool:
        return self.received is not None or self.reason is not None

    @property
    def cause(self) -> str:
        """What stopped the run, in a word or two: the signal's name, ``the time limit``."""
        if self.received:
            return signal.Signals(self.received).name
        return self.reason or "a signal"

    @property
    def name(self) -> str:
        """``cause`` with its detail, for the log."""
        return f"{self.cause} ({self.detail})" if self.detail and not self.received \
            else self.cause


class StopAgreement:
    """Whether any rank of ``comm`` had a signal, the same answer on every rank.
    Collective to build (it probes for persistent collectives)."""

    def __init__(self, comm: MPI.Comm, flag: SignalFlag, timeout: float, every: int = 1,
                 deadline=None):
        """``deadline``: a ``deadline.Deadline``; once it has passed on a rank, that rank
        asks to stop as if it had a signal."""
        self.comm, self.flag, self.timeout, self.every = comm, flag, timeout, every
        self.deadline = deadline
        self._req: MPI.Request | None = None
        self._send = np.zeros(1, dtype=np.int64)
        self._recv = np.zeros(1, dtype=np.int64)
        self.resources = MPIResources()
        self._persistent: MPI.Prequest | None = None
        if comm.Get_size() > 1 and persistent_collectives(comm, timeout):
            self._persistent = self.resources.add(
                comm.Allreduce_init(self._send, self._recv, op=MPI.MAX), self._free)

    def agreed(self, step: int) -> bool:
        """Call after every step on every rank: True when some rank had a signal by the
        previous agreement (then all ranks return True after the same step)."""
        if step % self.every:
            return False
        return self.poll()

    def poll(self) -> bool:
        """One agreement, whatever the step: read the one started last (True when some
        rank had a reason to stop by then) and start the next. Every rank calls it at
        the same points: after a step (``agreed``), before each forward pass of an
        evaluation, so that a long evaluation stops within two of its passes."""
        stop = self._finish_pending()
        self._send[0] = self._reason_code()
        if self._persistent is not None:
            self._persistent.Start()
            self._req = self._persistent
        else:
            self._req = self.comm.Iallreduce(self._send, self._recv, op=MPI.MAX)
        return stop

    def now(self, what: str) -> bool:
        """Blocking agreement (every rank calls it at the same point): True when some
        rank has had a signal."""
        self._finish_pending()
        code = int(allreduce_array(self.comm, [self._reason_code()], op=MPI.MAX,
                                   timeout=self.timeout,
                                   what=f"stop-signal agreement ({what})")[0])
        self._adopt(code)
        return code != NO_STOP

    def local_stop(self) -> bool:
        """Whether this rank has a reason to stop (a signal, or its deadline has passed),
        without asking the others: for work only one rank does (the sample)."""
        if self.deadline is not None and not self.flag.stopping and self.deadline.passed():
            self.flag.trip(TIME_LIMIT, self.deadline.describe())
        return self.flag.stopping

    def _reason_code(self) -> int:
        """This rank's ``REASON_CODES`` entry (asks the deadline, as ``local_stop``)."""
        if not self.local_stop():
            return NO_STOP
        return SIGNAL_BASE + self.flag.received if self.flag.received else DEADLINE_CODE

    def _adopt(self, code: int) -> None:
        """Take the agreed reason where this rank has none of its own."""
        if code == NO_STOP or self.flag.stopping:
            return
        if code == DEADLINE_CODE:
            self.flag.trip(TIME_LIMIT, "another rank's deadline passed first")
        else:
            self.flag.received = code - SIGNAL_BASE

    def _finish_pending(self) -> bool:
        if self._req is None:
            return False
        wait_all([self._req], timeout=self.timeout, what="stop-signal agreement")
        self._req = None
        self._adopt(int(self._recv[0]))
        return self._recv[0] != NO_STOP

    def _free(self) -> None:
        # Still active only after an error elsewhere (close() completes it): MPI may not
        # free an active persistent collective, and finalize releases it anyway.
        if self._req is None or self._req.Test():
            self._persistent.Free()

    def close(self) -> None:
        if self._req is not None and not MPI.Is_finalized():
            self._finish_pending()
        self.resources.close()
