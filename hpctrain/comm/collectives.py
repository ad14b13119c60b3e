"""Small collectives for metadata and metrics, each with a watchdog deadline.

Tensors use the uppercase (buffer) MPI calls; these helpers are for a handful of numbers
(losses, counts, flags), launched nonblocking so the wait can carry a deadline.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from hpctrain.comm.watchdog import wait_all


def allreduce_array(comm: MPI.Comm, values, *, timeout: float, what: str,
                    op: MPI.Op = MPI.SUM) -> np.ndarray:
    """Elementwise reduction of a small float64 (or int64) vector over ``comm``."""
    arr = np.ascontiguousarray(values)
    if arr.dtype.kind == "f":
        arr = arr.astype(np.float64)
    elif arr.dtype.kind in "iub":
        arr = arr.astype(np.int64)
    if comm.Get_size() == 1:
        return arr.copy()
    out = np.empty_like(arr)
    wait_all([comm.Iallreduce(arr, out, op=op)], timeout=timeout, what=what)
    return out


def barrier(comm: MPI.Comm, *, timeout: float, what: str) -> None:
    if comm.Get_size() > 1:
        wait_all([comm.Ibarrier()], timeout=timeout, what=what)


def any_true(comm: MPI.Comm, flag: bool, *, timeout: float, what: str) -> bool:
    return bool(allreduce_array(comm, [int(flag)], timeout=timeout, what=what, op=MPI.MAX)[0])
