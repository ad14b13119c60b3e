"""Small collectives for metadata and metrics, each with a watchdog deadline.

Tensors use the uppercase (buffer) MPI calls; these helpers are for a handful of numbers
(losses, counts, flags), launched nonblocking so the wait can carry a deadline.
``option`` names the setting that gave ``timeout`` in the watchdog's message.
"""

from __future__ import annotations

import json

import numpy as np

from hpctrain.comm.mpi import MPI
from hpctrain.comm.watchdog import wait_all

_OPTION = "--comm.timeout"


def allreduce_array(comm: MPI.Comm, values, *, timeout: float, what: str,
                    op: MPI.Op | None = None, option: str = _OPTION) -> np.ndarray:
    """Elementwise reduction (``op``, default ``MPI.SUM``) of a small float64 (or int64)
    vector over ``comm``."""
    op = MPI.SUM if op is None else op
    arr = np.ascontiguousarray(values)
    if arr.dtype.kind == "f":
        arr = arr.astype(np.float64)
    elif arr.dtype.kind in "iub":
        arr = arr.astype(np.int64)
    if comm.Get_size() == 1:
        return arr.copy()
    out = np.empty_like(arr)
    wait_all([comm.Iallreduce(arr, out, op=op)], timeout=timeout, what=what, option=option)
    return out


def barrier(comm: MPI.Comm, *, timeout: float, what: str, option: str = _OPTION) -> None:
    if comm.Get_size() > 1:
        wait_all([comm.Ibarrier()], timeout=timeout, what=what, option=option)


def any_true(comm: MPI.Comm, flag: bool, *, timeout: float, what: str) -> bool:
    return bool(allreduce_array(comm, [int(flag)], timeout=timeout, what=what, op=MPI.MAX)[0])


def bcast_json(comm: MPI.Comm, obj, *, timeout: float, what: str, root: int = 0,
               option: str = _OPTION):
    """``root``'s JSON-able ``obj`` on every rank (metadata: paths, flags, small dicts)."""
    if comm.Get_size() == 1:
        return obj
    data = json.dumps(obj).encode() if comm.Get_rank() == root else b""
    n = np.array([len(data)], dtype=np.int64)
    wait_all([comm.Ibcast(n, root=root)], timeout=timeout, what=what, option=option)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if comm.Get_rank() == root \
        else np.empty(int(n[0]), dtype=np.uint8)
    wait_all([comm.Ibcast(buf, root=root)], timeout=timeout, what=what, option=option)
    return json.loads(buf.tobytes().decode())


def _gathered_sizes(comm: MPI.Comm, data: np.ndarray, *, timeout: float, what: str,
                    option: str) -> np.ndarray:
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    wait_all([comm.Iallgather(np.array([data.size], dtype=np.int64), sizes)],
             timeout=timeout, what=what, option=option)
    return sizes


def _split_json(recv: np.ndarray, sizes: np.ndarray) -> list:
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [json.loads(recv[offsets[i]:offsets[i + 1]].tobytes().decode())
            for i in range(len(sizes))]


def gather_json(comm: MPI.Comm, obj, *, timeout: float, what: str, root: int = 0,
                option: str = _OPTION):
    """Every rank's JSON-able ``obj``, as a list on ``root`` (None elsewhere)."""
    if comm.Get_size() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
    sizes = _gathered_sizes(comm, data, timeout=timeout, what=what, option=option)
    recv = np.empty(int(sizes.sum()), dtype=np.uint8) if comm.Get_rank() == root else None
    spec = [recv, (sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]])), MPI.BYTE] \
        if recv is not None else None
    wait_all([comm.Igatherv(data, spec, root=root)], timeout=timeout, what=what,
             option=option)
    if comm.Get_rank() != root:
        return None
    return _split_json(recv, sizes)


def allgather_json(comm: MPI.Comm, obj, *, timeout: float, what: str,
                   option: str = _OPTION) -> list:
    """Every rank's JSON-able ``obj``, as a list on every rank (tuples come back as
    lists)."""
    if comm.Get_size() == 1:
        return [json.loads(json.dumps(obj))]
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8).copy()
    sizes = _gathered_sizes(comm, data, timeout=timeout, what=what, option=option)
    recv = np.empty(int(sizes.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    wait_all([comm.Iallgatherv(data, [recv, (sizes, displs), MPI.BYTE])],
             timeout=timeout, what=what, option=option)
    return _split_json(recv, sizes)
