"""``XcclTransport`` (``--comm.transport=xccl``): the engines' buckets and shards moved by
the device's collective library through ``torch.distributed`` (NCCL, RCCL, oneCCL; gloo
for host memory), on a stream of its own. The process groups it runs on, and why a GPU
request counts as done once issued, are in ``device_collectives.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.comm.device import Accelerator
from hpctrain.comm.device_collectives import all_gather_tensor, group_for, reduce_scatter_tensor
from hpctrain.comm.mpi import MPI


class XcclRequest:
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


class XcclBuffer:
    """A tensor as the device library sees it: no staging copy, an event behind its
    last write, and what ``complete()`` must do after its collective."""

    staging_nbytes = 0

    def __init__(self, tensor: torch.Tensor, accel: Accelerator, stream_ordered: bool):
        self.tensor, self.accel, self.stream_ordered = tensor, accel, stream_ordered
        self.on_device = accel.holds(tensor)
        self._event = accel.event() if self.on_device else None
        self._ready = None
        self.recorded = None
        """The event of the last ``prepare()``, kept after it is waited for (see
        ``XcclTransport._hand_over``)."""
        self.work = None
        self.after = None
        """A copy queued once the collective is done (the reduce-scatter's shard)."""
        self.keep = None
        """A temporary the collective reads (kept until ``complete()``)."""

    def prepare(self, send: bool = True) -> None:
        if self._event is not None:
            self._ready = self.recorded = self._event.record()

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


class XcclTransport:
    """``Transport`` over a ``torch.distributed`` process group."""

    def __init__(self, comm: MPI.Comm, accel: Accelerator, purpose: str = "reduce"):
        self.comm, self.accel, self.purpose = comm, accel, purpose
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.group = group_for(comm, purpose)
        self.name = dist.get_backend(self.group)
        self.stream_ordered = accel.kind in ("cuda", "xpu")
        self.stream = accel.module.Stream() if self.stream_ordered else None
        self._scratch: dict[int, torch.Tensor] = {}

    def buffer(self, tensor, *, reduction: bool = False, raw: bool = False) -> XcclBuffer:
        return XcclBuffer(tensor, self.accel, self.stream_ordered)

    def _hand_over(self, buf: XcclBuffer) -> None:
        """Order the library's read of ``buf`` after its last device work, and tell the
        device of the handoff: a host backend must have waited for the event (the fake
        device's events pass only when waited for or seen, so a skipped wait counts as an
        unready handoff); a GPU's stream waits on the device instead."""
        buf.wait_ready(self.stream)
        if buf.on_device:
            self.accel.note_handoff(True, None if self.stream_ordered else buf.recorded)

    def _issue(self, buf: XcclBuffer, op, *, pollable: bool = True) -> XcclRequest:
        self._hand_over(buf)
        if self.stream is not None:
            with self.accel.module.stream(self.stream):
                buf.work = op()
        else:
            buf.work = op()
        return XcclRequest(buf.work, stream_ordered=self.stream_ordered, pollable=pollable)

    def allreduce(self, buf: XcclBuffer) -> XcclRequest:
        return self._issue(buf, lambda: dist.all_reduce(buf.tensor, group=self.group,
                                                        async_op=True))

    def reduce_scatter(self, buf: XcclBuffer) -> XcclRequest:
        t, n = buf.tensor, buf.tensor.numel() // self.size
        if self.name == "gloo":
            # gloo's reduce-scatter runs synchronously on a work that never reports
            # completion: sum the whole buffer, then move this rank's slice to the start.
            buf.after = lambda: t[:n].copy_(t[self.rank * n:(self.rank + 1) * n].clone())
            return self.allreduce(buf)
        out = self._scratch.setdefault(id(t), torch.empty(n, dtype=t.dtype, device=t.device))
        buf.after = lambda: t[:n].copy_(out)
        return self._issue(buf, lambda: reduce_scatter_tensor(
            out, t, group=self.group, async_op=True))

    def allgather(self, buf: XcclBuffer, shard: XcclBuffer | None = None) -> XcclRequest:
        t = buf.tensor
        n = t.numel() // self.size
        if shard is not None:
            self._hand_over(shard)
            source = shard.tensor
        else:  # the input is part of the output: gather from a copy of it
            source = t[self.rank * n:(self.rank + 1) * n].clone()
            buf.prepare()  # behind the copy
        buf.keep = source  # alive until complete(): the device reads it meanwhile
        return self._issue(buf, lambda: all_gather_tensor(
            t, source, group=self.group, async_op=True))

    def allgather_each(self, bufs: list[XcclBuffer]) -> list[XcclRequest]:
        return [self.allgather(b) for b in bufs]

    def broadcast_each(self, bufs: list[XcclBuffer], root: int) -> list[XcclRequest]:
        return [self.broadcast(b, root) for b in bufs]

    def broadcast(self, buf: XcclBuffer, root: int) -> XcclRequest:
        src = dist.get_global_rank(self.group, root)
        return self._issue(buf, lambda: dist.broadcast(buf.tensor, src, group=self.group,
                                                       async_op=True))

    def send(self, buf: XcclBuffer, peer: int, tag: int) -> XcclRequest:
        dst = dist.get_global_rank(self.group, peer)
        return self._issue(buf, lambda: dist.isend(buf.tensor, dst, group=self.group, tag=tag),
                           pollable=False)

    def recv(self, buf: XcclBuffer, peer: int, tag: int) -> XcclRequest:
        src = dist.get_global_rank(self.group, peer)
        return self._issue(buf, lambda: dist.irecv(buf.tensor, src, group=self.group, tag=tag),
                           pollable=False)

    def sibling(self) -> "XcclTransport":
        return XcclTransport(self.comm, self.accel, purpose="gather")

    def close(self) -> None:
        """Nothing: the groups live as long as the process (they are kept for reuse)."""
