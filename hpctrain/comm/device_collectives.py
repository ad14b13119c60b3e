"""Device collective libraries under our own buckets (``--comm.transport=xccl``).

The engines keep their logic (buckets, their order, ZeRO's shards); ``XcclTransport``
(``xccl_transport.py``) moves the bytes with the vendor's library through
``torch.distributed``: NCCL (RCCL under ROCm), XCCL (oneCCL) on Intel GPUs, gloo for host
memory. This module starts it the MPI way, not torchrun's: rank 0 opens a ``TCPStore``
and broadcasts its address with mpi4py, and the grid's groups are made in one fixed
order and kept per (purpose, ranks). Collectives run on a communication stream ordered
by events, so the host never waits; a hung one ends at the library's own timeout.
Start-up, ordering and deadlines: docs/design/collectives.md.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from hpctrain.comm.device import Accelerator
from hpctrain.comm.mpi import MPI
from hpctrain.errors import UserError

BACKENDS = {"cuda": "nccl", "xpu": "xccl", "cpu": "gloo", "fake": "gloo"}
"""The torch.distributed backend for each device kind."""

_groups: dict[tuple[str, tuple[int, ...]], object] = {}
# The one-tensor forms of all-gather and reduce-scatter (renamed in newer torch builds).
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backend_for(kind: str) -> str | None:
    """The backend of device ``kind`` if this torch build has it, else None."""
    backend = BACKENDS.get(kind)
    if backend is None or not dist.is_available():
        return None
    available = {"nccl": dist.is_nccl_available, "gloo": dist.is_gloo_available,
                 "xccl": getattr(dist, "is_xccl_available", lambda: False)}
    return backend if available[backend]() else None


def start(comm: MPI.Comm, accel: Accelerator, timeout: float) -> str:
    """Join (once per process) the default process group over ``comm``'s ranks, which
    must be all of ``MPI.COMM_WORLD``; returns the backend. Collective over ``comm``."""
    backend = backend_for(accel.kind)
    if backend is None:
        raise UserError(f"--comm.transport=xccl: this torch build ({torch.__version__}) has "
                        f"no {BACKENDS.get(accel.kind, '?')} backend for {accel.kind}; use "
                        "--comm.transport=mpi")
    if comm.Get_size() != MPI.COMM_WORLD.Get_size():
        raise UserError("--comm.transport=xccl needs a world of every rank the job "
                        "started (MPI.COMM_WORLD)")
    if dist.is_initialized():
        if dist.get_backend() != backend or dist.get_world_size() != comm.Get_size():
            raise UserError(f"a {dist.get_backend()} process group of "
                            f"{dist.get_world_size()} rank(s) exists already; this world "
                            f"needs {backend} over {comm.Get_size()}")
        register(list(range(comm.Get_size())), "reduce", dist.group.WORLD)
        return backend
    wait = datetime.timedelta(seconds=timeout)
    host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
    store, address = None, None
    if comm.Get_rank() == 0:
        store = dist.TCPStore(host, 0, comm.Get_size(), is_master=True,
                              wait_for_workers=False, timeout=wait)
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, comm.Get_size(), is_master=False, timeout=wait)
    extra = {"device_id": accel.torch_device} if backend == "nccl" else {}
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=wait, **extra)
    register(list(range(comm.Get_size())), "reduce", dist.group.WORLD)
    return backend


def stop() -> None:
    """Leave the default process group and forget the groups made in it (collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _groups.clear()


def world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """``comm``'s ranks as ranks of ``MPI.COMM_WORLD`` (the default group's numbering)."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return tuple(group.Translate_ranks(list(range(comm.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def register(ranks: list[int], purpose: str, group) -> None:
    _groups[(purpose, tuple(ranks))] = group


def make_groups(partition: list[list[int]], purpose: str) -> None:
    """A process group for every rank set of ``partition`` (world ranks), made by every
    rank of the job in the same order (``dist.new_group`` is collective over the default
    group); sets already made for ``purpose`` are kept."""
    for ranks in partition:
        key = (purpose, tuple(ranks))
        if key not in _groups:
            _groups[key] = dist.new_group(list(ranks))


def group_for(comm: MPI.Comm, purpose: str = "reduce"):
    """The process group over ``comm``'s ranks made for ``purpose``."""
    key = (purpose, world_ranks(comm))
    if key not in _groups:
        raise RuntimeError(f"no {purpose} process group over world ranks {list(key[1])}: "
                           "make_groups must run for it on every rank first")
    return _groups[key]


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group) -> None:
    """Every rank's ``t`` into ``out`` (flat, rank order); blocking on the host backends,
    ordered on the compute stream on a GPU."""
    all_gather_tensor(out, t, group=group)


def reduce_scatter_into(work: torch.Tensor, group, rank: int) -> torch.Tensor:
    """The sum over ``group`` of ``work`` (shape (size, ...)), this rank's row of it.
    gloo has no reduce-scatter: it sums everything and keeps the row."""
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(work, group=group)
        return work[rank]
    out = torch.empty(work.shape[1:], dtype=work.dtype, device=work.device)
    reduce_scatter_tensor(out.view(-1), work.view(-1), group=group)
    return out
