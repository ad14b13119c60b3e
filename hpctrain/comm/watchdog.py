"""Deadlines on MPI waits: a stuck or dead peer must end the job, not hang it.

A plain ``MPI.Request.Waitall`` blocks forever if a peer never arrives. Here every wait
polls with ``Testall`` (which also drives MPICH's progress engine) and raises
``CommTimeout`` naming what was awaited once the deadline passes; the abort handler
(``hpctrain.comm.abort``) then takes the whole job down with that message.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from hpctrain.errors import CommTimeout

# Spin briefly (an MPI collective on shared memory finishes in microseconds), then back
# off so ranks oversubscribing cores give their core to the peer they are waiting for.
_SPIN_POLLS = 200
_MAX_SLEEP_S = 1e-3


def wait_all(requests: list[MPI.Request], *, timeout: float, what: str) -> None:
    """Wait for ``requests``; raise ``CommTimeout`` after ``timeout`` seconds."""
    if not requests or MPI.Request.Testall(requests):
        return
    deadline = time.monotonic() + timeout
    polls, sleep = 0, 2e-5
    while not MPI.Request.Testall(requests):
        polls += 1
        if polls > _SPIN_POLLS:
            if time.monotonic() > deadline:
                raise CommTimeout(
                    f"{what} did not complete within {timeout:g} s (--comm.timeout): "
                    "another rank is stuck, dead, or skipped this operation")
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)


def wait(request: MPI.Request, *, timeout: float, what: str) -> None:
    wait_all([request], timeout=timeout, what=what)
