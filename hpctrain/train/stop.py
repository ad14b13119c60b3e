"""Stopping on the scheduler's signal: save a checkpoint and exit cleanly.

PBS and SLURM send SIGTERM (SLURM also SIGUSR1 with ``--signal``) before they kill a job
at its walltime; ``mpiexec`` forwards it to every rank. Ranks may see it at different
steps, so they agree before acting: each step starts a nonblocking allreduce (MAX) of
"a signal arrived here" and the next step reads it. Every rank reads the same
reduction, so all stop after the same step, save the same checkpoint, and exit. The
agreement runs every ``CHECK_EVERY`` steps, which keeps its cost out of short steps.
"""

from __future__ import annotations

import signal
import threading

import numpy as np
from mpi4py import MPI

from hpctrain.comm.watchdog import wait_all

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
CHECK_EVERY = 10  # steps between agreements: a signal is acted on within 20 steps


class StopOnSignal:
    def __init__(self, comm: MPI.Comm, timeout: float):
        self.comm, self.timeout = comm, timeout
        self.received: int | None = None
        self._previous: dict = {}
        self._req: MPI.Request | None = None
        self._send = np.zeros(1, dtype=np.int64)
        self._recv = np.zeros(1, dtype=np.int64)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # Python's rule
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._req is not None and not MPI.Is_finalized():
            wait_all([self._req], timeout=self.timeout, what="stop-signal agreement")
            self._req = None

    def _on_signal(self, signum, _frame) -> None:
        self.received = signum

    def agreed(self, step: int) -> bool:
        """Call after every step on every rank: True when some rank had a signal by the
        previous agreement (then all ranks return True after the same step)."""
        if step % CHECK_EVERY:
            return False
        stop = False
        if self._req is not None:
            wait_all([self._req], timeout=self.timeout, what="stop-signal agreement")
            stop = bool(self._recv[0])
        self._send[0] = int(self.received is not None)
        self._req = self.comm.Iallreduce(self._send, self._recv, op=MPI.MAX)
        return stop

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else "a signal"
