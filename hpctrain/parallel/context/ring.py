"""The ranks of one context-parallel group as a ring: each step every rank passes a
tensor to one neighbour and takes the same-shaped tensor from the other, non-blocking,
so the transfer runs while the current block is computed.

One interface, ``Ring``, with two ways to move the blocks, chosen in ``Ring.of_world``
by the run's transport (``--comm.transport``): ``MPIRing`` (mpi4py's ``Isend``/``Irecv``)
and ``DeviceRing`` (``torch.distributed``'s batched point-to-point over the group's
``ring`` process group, ``comm/grid.py``: NCCL, XCCL, gloo on the host). The group's
communicator is a parameter (never a global). Every wait has the run's deadline and
names the step it waited for.
"""

from __future__ import annotations

import datetime

import torch

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import HOST_MEMORY, GPUAwareness
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import DEFAULT_TIMEOUT_S
from hpctrain.errors import CommTimeout

RING_GROUP = "ring"
"""The purpose of the device library's process groups of the rings (``comm/grid.py``)."""


class Transfer:
    """One posted shift over MPI: the send of a tensor and the receive of its successor."""

    def __init__(self, requests: list, sent: MPIBuffer, received: torch.Tensor,
                 recv_buffer: MPIBuffer, timeout: float, what: str):
        self._requests, self._received, self._recv_buffer = requests, received, recv_buffer
        self._sent = sent  # its memory must live until the send completes
        self._timeout, self._what = timeout, what

    def wait(self) -> torch.Tensor:
        """The tensor received (the send is complete too), or ``CommTimeout``."""
        wait_all(self._requests, timeout=self._timeout, what=self._what)
        self._recv_buffer.complete()
        return self._received


class DeviceTransfer:
    """One posted shift on the device library: its works (receive first, then send)."""

    def __init__(self, works: list, sent: torch.Tensor, received: torch.Tensor,
                 stream_ordered: bool, timeout: float, what: str):
        self._works, self._received = works, received
        self._sent = sent  # its memory must live until the send completes
        self._stream_ordered, self._timeout, self._what = stream_ordered, timeout, what

    def wait(self) -> torch.Tensor:
        """The tensor received, or ``CommTimeout``. On a GPU the current stream waits for
        the transfer (the library's own timeout ends a hung one, as for its collectives);
        on the host each work is waited for with the deadline. gloo's point-to-point
        cannot be polled and closes the connection when a wait times out, so a timeout
        here ends the ring: the job aborts on it, as on MPI's."""
        if self._stream_ordered:
            for work in self._works:
                work.wait()
            return self._received
        deadline = datetime.timedelta(seconds=self._timeout)
        for work in self._works:
            try:
                work.wait(deadline)
            except RuntimeError as err:
                raise CommTimeout(
                    f"{self._what} did not complete within {self._timeout:g} s "
                    "(--comm.timeout): another rank is stuck, dead, or skipped this "
                    f"operation ({str(err).splitlines()[0][-200:]})") from err
        return self._received


class Ring:
    """A context-parallel group's communicator with its ring neighbours; ``shift`` moves
    the blocks (``MPIRing``, ``DeviceRing``)."""

    def __init__(self, comm, *, timeout: float = DEFAULT_TIMEOUT_S,
                 accel: Accelerator | None = None, aware: GPUAwareness = HOST_MEMORY):
        """``comm``: the group's mpi4py communicator, ranks in ring order; ``timeout``:
        the deadline of every wait (``--comm.timeout``); ``accel``/``aware``: the
        rank's device and whether its MPI reads device memory (default: host)."""
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.timeout, self.accel, self.aware = timeout, accel, aware

    @staticmethod
    def of_world(comm, world) -> "Ring":
        """The ring over ``comm`` with ``world``'s device, GPU awareness and deadline:
        on the device library under ``--comm.transport=xccl``, else on MPI."""
        kind = DeviceRing if world.collectives == "xccl" and comm.Get_size() > 1 else MPIRing
        return kind(comm, timeout=world.timeout, accel=world.accel, aware=world.gpu_aware)

    def neighbour(self, offset: int) -> int:
        """The rank ``offset`` places along the ring (negative: backwards)."""
        return (self.rank + offset) % self.size

    def shift(self, t: torch.Tensor, direction: int, tag: int, what: str):
        """Post the send of ``t`` to the rank ``direction`` (+1 or -1) along the ring and
        the receive of the tensor of the rank ``-direction`` along it; ``t`` must stay
        unchanged until the returned transfer's ``wait`` (which gives the tensor
        received). ``tag`` keeps two streams of blocks between the same neighbours
        apart where the library has tags; ``what`` names the wait in a timeout."""
        raise NotImplementedError

    def _what(self, what: str, source: int) -> str:
        return f"context-parallel ring: {what} from rank {source}"


class MPIRing(Ring):
    """The ring on MPI: ``Isend``/``Irecv`` with tags, staged through host memory when
    MPI cannot read the device's (``comm/buffers.py``)."""

    def shift(self, t: torch.Tensor, direction: int, tag: int, what: str) -> Transfer:
        t = t.contiguous()
        received = torch.empty_like(t)
        send = MPIBuffer(t, self.accel, self.aware)
        recv = MPIBuffer(received, self.accel, self.aware)
        recv.prepare(send=False)  # only written: nothing to stage
        send_obj, recv_obj = to_mpi_all([send, recv])
        dest, source = self.neighbour(direction), self.neighbour(-direction)
        requests = [self.comm.Irecv(recv_obj, source=source, tag=tag),
                    self.comm.Isend(send_obj, dest=dest, tag=tag)]
        return Transfer(requests, send, received, recv, self.timeout,
                        self._what(what, source))


class DeviceRing(Ring):
    """The ring on the device library (``--comm.transport=xccl``): each shift is one
    ``batch_isend_irecv`` of a receive and a send over the group's ``ring`` process
    group. NCCL has no tags and matches a pair's messages in the order they are posted,
    so every rank posts its shifts in the same order (``ring_attention.py`` does: the
    same schedule on every rank) and each batch in the same order, receive first."""

    def __init__(self, comm, **kwargs):
        super().__init__(comm, **kwargs)
        from hpctrain.comm.device_collectives import group_for, world_ranks

        self.group = group_for(comm, RING_GROUP)
        self._global = world_ranks(comm)
        self._stream_ordered = self.accel is not None and self.accel.kind in ("cuda", "xpu")

    def shift(self, t: torch.Tensor, direction: int, tag: int, what: str) -> DeviceTransfer:
        import torch.distributed as dist

        t = t.contiguous()
        if self.accel is not None and self.accel.holds(t) and not self._stream_ordered:
            self.accel.event().record().wait()  # a host backend reads it now
        received = torch.empty_like(t)
        dest, source = self.neighbour(direction), self.neighbour(-direction)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.irecv, received, self._global[source], self.group, tag),
            dist.P2POp(dist.isend, t, self._global[dest], self.group, tag)])
        return DeviceTransfer(works, t, received, self._stream_ordered, self.timeout,
                              self._what(what, source))
