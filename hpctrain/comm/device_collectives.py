"""Device collective libraries under our own buckets (``--comm.transport=xccl``).

The engines keep their logic (buckets, their order, ZeRO's shards); ``DeviceTransport``
moves the bytes with the vendor's library through ``torch.distributed``: NCCL on NVIDIA
GPUs (RCCL under ROCm, which torch also calls ``nccl``), XCCL (oneCCL) on Intel GPUs,
and gloo for host memory (the CPU and the fake device: how the tests run this path).

Start-up is MPI's, not torchrun's: rank 0 opens a ``TCPStore`` on a free port and
broadcasts its address with mpi4py (``MASTER_ADDR`` picks the interface when set); every
rank then joins the default process group over the same ranks as the MPI world. The
groups of the process grid (data-parallel replicas, pipelines, and a second group per
data-parallel set for ZeRO-3's gathers) are created by every rank in one fixed order and
kept per (purpose, ranks), so building the same grid again reuses them.

Ordering. A bucket's buffer is written by kernels on the compute stream; ``prepare()``
records an event there, and the collective is issued on a communication stream that
waits for that event, so it overlaps the rest of backward without the host waiting for
anything. ``complete()`` makes the compute stream wait for the collective (no host
sync either). On a GPU a request therefore counts as done as soon as it is issued: the
device orders everything, and a collective that never completes is ended by the
library's own watchdog after ``--comm.timeout`` (the process group's timeout), which
takes the process, and so the job, down. Host-memory backends (gloo) complete on their
own threads: their requests answer ``Test()`` honestly, and a point-to-point request,
which gloo cannot poll, waits when tested.
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
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    _all_gather(out, t, group=group)


def reduce_scatter_into(work: torch.Tensor, group, rank: int) -> torch.Tensor:
    """The sum over ``group`` of ``work`` (shape (size, ...)), this rank's row of it.
    gloo has no reduce-scatter: it sums everything and keeps the row."""
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(work, group=group)
        return work[rank]
    out = torch.empty(work.shape[1:], dtype=work.dtype, device=work.device)
    _reduce_scatter(out.view(-1), work.view(-1), group=group)
    return out


class DeviceRequest:
    """A collective issued on the device library. ``stream_ordered``: the device orders
    it (a GPU backend), so it is done for the host once issued."""

    def __init__(self, work, *, stream_ordered: bool, pollable: bool = True):
        self.work, self.stream_ordered, self.pollable = work, stream_ordered, pollable

    def Test(self) -> bool:
        if self.stream_ordered or self.work is None:
            return True
        if not self.pollable:  # gloo's point-to-point work cannot be polled
            self.work.wait()
            return True
        return self.work.is_completed()


class DeviceBuffer:
    """A tensor as the device library sees it: no staging copy, an event behind its
    last write, and what ``complete()`` must do after its collective."""

    staging_nbytes = 0

    def __init__(self, tensor: torch.Tensor, accel: Accelerator, stream_ordered: bool):
        self.tensor, self.accel, self.stream_ordered = tensor, accel, stream_ordered
        self.on_device = accel.holds(tensor)
        self._event = accel.event() if self.on_device else None
        self._ready = None
        self.work = None
        self.after = None
        """A copy queued once the collective is done (the reduce-scatter's shard)."""
        self.keep = None
        """A temporary the collective reads (kept until ``complete()``)."""

    def prepare(self, send: bool = True) -> None:
        if self._event is not None:
            self._ready = self._event.record()

    def ready(self) -> bool:
        return self.stream_ordered or self._ready is None or self._ready.query()

    def wait_ready(self, stream) -> None:
        """Before the collective: a GPU's communication ``stream`` waits for the event;
        a host backend's thread reads the memory now, so the host waits for it."""
        if self._ready is None:
            return
        if self.stream_ordered and stream is not None:
            stream.wait_event(self._ready.raw)
        else:
            self._ready.wait()
        self._ready = None

    def complete(self) -> None:
        if self.work is not None:
            self.work.wait()  # GPU: the current stream waits; host: the result is in
            self.work = None
        if self.after is not None:
            self.after()
            self.after = None
        self.keep = None


class DeviceTransport:
    """``Transport`` over a ``torch.distributed`` process group."""

    def __init__(self, comm: MPI.Comm, accel: Accelerator, purpose: str = "reduce"):
        self.comm, self.accel, self.purpose = comm, accel, purpose
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.group = group_for(comm, purpose)
        self.name = dist.get_backend(self.group)
        self.stream_ordered = accel.kind in ("cuda", "xpu")
        self.stream = accel.module.Stream() if self.stream_ordered else None
        self._scratch: dict[int, torch.Tensor] = {}

    def buffer(self, tensor, *, reduction: bool = False, raw: bool = False) -> DeviceBuffer:
        return DeviceBuffer(tensor, self.accel, self.stream_ordered)

    def _issue(self, buf: DeviceBuffer, op, *, pollable: bool = True) -> DeviceRequest:
        buf.wait_ready(self.stream)
        if self.stream is not None:
            with self.accel.module.stream(self.stream):
                buf.work = op()
        else:
            buf.work = op()
        return DeviceRequest(buf.work, stream_ordered=self.stream_ordered, pollable=pollable)

    def allreduce(self, buf: DeviceBuffer) -> DeviceRequest:
        return self._issue(buf, lambda: dist.all_reduce(buf.tensor, group=self.group,
                                                        async_op=True))

    def reduce_scatter(self, buf: DeviceBuffer) -> DeviceRequest:
        t, n = buf.tensor, buf.tensor.numel() // self.size
        if self.name == "gloo":
            # gloo's reduce-scatter runs synchronously on a work that never reports
            # completion: sum the whole buffer, then move this rank's slice to the start.
            buf.after = lambda: t[:n].copy_(t[self.rank * n:(self.rank + 1) * n].clone())
            return self.allreduce(buf)
        out = self._scratch.setdefault(id(t), torch.empty(n, dtype=t.dtype, device=t.device))
        buf.after = lambda: t[:n].copy_(out)
        return self._issue(buf, lambda: _reduce_scatter(
            out, t, group=self.group, async_op=True))

    def allgather(self, buf: DeviceBuffer, shard: DeviceBuffer | None = None) -> DeviceRequest:
        t = buf.tensor
        n = t.numel() // self.size
        if shard is not None:
            shard.wait_ready(self.stream)
            source = shard.tensor
        else:  # the input is part of the output: gather from a copy of it
            source = t[self.rank * n:(self.rank + 1) * n].clone()
            buf.prepare()  # behind the copy
        buf.keep = source  # alive until complete(): the device reads it meanwhile
        return self._issue(buf, lambda: _all_gather(
            t, source, group=self.group, async_op=True))

    def allgather_each(self, bufs: list[DeviceBuffer]) -> list[DeviceRequest]:
        return [self.allgather(b) for b in bufs]

    def broadcast_each(self, bufs: list[DeviceBuffer], root: int) -> list[DeviceRequest]:
        return [self.broadcast(b, root) for b in bufs]

    def broadcast(self, buf: DeviceBuffer, root: int) -> DeviceRequest:
        src = dist.get_global_rank(self.group, root)
        return self._issue(buf, lambda: dist.broadcast(buf.tensor, src, group=self.group,
                                                       async_op=True))

    def send(self, buf: DeviceBuffer, peer: int, tag: int) -> DeviceRequest:
        dst = dist.get_global_rank(self.group, peer)
        return self._issue(buf, lambda: dist.isend(buf.tensor, dst, group=self.group, tag=tag),
                           pollable=False)

    def recv(self, buf: DeviceBuffer, peer: int, tag: int) -> DeviceRequest:
        src = dist.get_global_rank(self.group, peer)
        return self._issue(buf, lambda: dist.irecv(buf.tensor, src, group=self.group, tag=tag),
                           pollable=False)

    def sibling(self) -> "DeviceTransport":
        return DeviceTransport(self.comm, self.accel, purpose="gather")

    def close(self) -> None:
        """Nothing: the groups live as long as the process (they are kept for reuse)."""
