"""Deadlines on MPI waits: a stuck or dead peer must end the job, not hang it.

A plain ``MPI.Request.Waitall`` blocks forever if a peer never arrives. Here every wait
polls with ``Testall`` (which also drives MPICH's progress engine) and raises
``CommTimeout`` naming what was awaited once the deadline passes; the abort handler
(``abort.py``) then takes the whole job down with that message. A failed poll yields the
core (waits longer than a second sleep between polls), and on a node with more ranks than
cores (``pace_for_node``) it sleeps briefly instead, so a peer sharing the core runs.
How it polls, and the measurements: docs/design/failure-handling.md ("Every wait has a deadline").
"""

from __future__ import annotations

import os
import time

from hpctrain.comm.mpi import MPI
from hpctrain.errors import CommTimeout

_CHECK_EVERY = 64  # polls between clock reads
OVERSUBSCRIBED_POLL_SLEEP_S = 5e-5
_pace = {"poll_sleep": 0.0}
"""The process's way of waiting: set once per process, from its node (``pace_for_node``)."""


def pace_for_node(oversubscribed: bool) -> None:
    """Waits on a node with more ranks (times their threads) than cores sleep
    ``OVERSUBSCRIBED_POLL_SLEEP_S`` between polls instead of yielding."""
    _pace["poll_sleep"] = OVERSUBSCRIBED_POLL_SLEEP_S if oversubscribed else 0.0
_YIELD_S = 1.0  # waits longer than this sleep between polls instead of yielding
_SLEEP_S = 1e-3


def test_all(requests: list[MPI.Request], statuses: list[MPI.Status] | None = None) -> bool:
    """``Testall``, one request at a time: MPICH 5.0's ``MPI_Testall`` reports an error
    for an active persistent collective (``Allreduce_init``), while ``MPI_Test`` works.
    With ``statuses``, each request's status is filled in as it completes; a completed
    (null) request is not tested again, which would overwrite its status with an empty
    one."""
    for i, req in enumerate(requests):
        if statuses is None:
            if not req.Test():
                return False
        elif req != MPI.REQUEST_NULL and not req.Test(statuses[i]):
            return False
    return True


def wait_all(requests: list[MPI.Request], *, timeout: float, what: str,
             poll_sleep: float = 0.0, option: str = "--comm.timeout",
             statuses: list[MPI.Status] | None = None, together: bool = False) -> None:
    """Wait for ``requests``; raise ``CommTimeout`` after ``timeout`` seconds.

    ``poll_sleep`` > 0 sleeps that long between polls instead of yielding (default: the
    node's pace, ``pace_for_node``). ``together``: every rank of the operation waits in
    it at the same time (an all-to-all), so each failed poll yields even on an
    oversubscribed node: a sleep there stalls every stage of the exchange. ``option`` is the setting that sets ``timeout``,
    named in the message (``hpctrain prepare`` has ``--timeout``). ``statuses`` (one per
    request) receive the requests' statuses, e.g. the bytes a write wrote."""
    if not requests:
        return
    poll_sleep = poll_sleep or (0.0 if together else _pace["poll_sleep"])
    start = time.monotonic()
    polls = 0
    sleeping = False
    while not test_all(requests, statuses):
        polls += 1
        if sleeping or poll_sleep:
            time.sleep(poll_sleep or _SLEEP_S)
        else:
            os.sched_yield()
        if polls % _CHECK_EVERY:
            continue
        waited = time.monotonic() - start
        if waited > timeout:
            raise CommTimeout(
                f"{what} did not complete within {timeout:g} s ({option}): "
                "another rank is stuck, dead, or skipped this operation")
        sleeping = waited > _YIELD_S


def wait(request: MPI.Request, *, timeout: float, what: str,
         option: str = "--comm.timeout", status: MPI.Status | None = None) -> None:
    wait_all([request], timeout=timeout, what=what, option=option,
             statuses=None if status is None else [status])
