"""The ranks of one context-parallel group as a ring: each step every rank passes a
tensor to one neighbour and takes the same-shaped tensor from the other, non-blocking,
so the transfer runs while the current block is computed.

The group's communicator is a parameter (never a global). Every wait has the run's
deadline (``comm/watchdog.py``) and names the step it waited for.
"""

from __future__ import annotations

import torch

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import HOST_MEMORY, GPUAwareness
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import DEFAULT_TIMEOUT_S


class Transfer:
    """One posted shift: the send of a tensor and the receive of its successor."""

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


class Ring:
    """A context-parallel group's communicator with its ring neighbours."""

    def __init__(self, comm, *, timeout: float = DEFAULT_TIMEOUT_S,
                 accel: Accelerator | None = None, aware: GPUAwareness = HOST_MEMORY):
        """``comm``: the group's mpi4py communicator, ranks in ring order; ``timeout``:
        the deadline of every wait (``--comm.timeout``); ``accel``/``aware``: the
        rank's device and whether its MPI reads device memory (default: host)."""
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.timeout, self.accel, self.aware = timeout, accel, aware

    @classmethod
    def of_world(cls, comm, world) -> "Ring":
        """A ring over ``comm`` with ``world``'s device, GPU awareness and deadline."""
        return cls(comm, timeout=world.timeout, accel=world.accel, aware=world.gpu_aware)

    def neighbour(self, offset: int) -> int:
        """The rank ``offset`` places along the ring (negative: backwards)."""
        return (self.rank + offset) % self.size

    def shift(self, t: torch.Tensor, direction: int, tag: int, what: str) -> Transfer:
        """Post the send of ``t`` to the rank ``direction`` (+1 or -1) along the ring and
        the receive of the tensor of the rank ``-direction`` along it; ``t`` must stay
        unchanged until the transfer's ``wait``. ``tag`` keeps two streams of blocks
        between the same neighbours apart; ``what`` names the wait in a timeout."""
        t = t.contiguous()
        received = torch.empty_like(t)
        send = MPIBuffer(t, self.accel, self.aware)
        recv = MPIBuffer(received, self.accel, self.aware)
        recv.prepare(send=False)  # only written: nothing to stage
        send_obj, recv_obj = to_mpi_all([send, recv])
        dest, source = self.neighbour(direction), self.neighbour(-direction)
        requests = [self.comm.Irecv(recv_obj, source=source, tag=tag),
                    self.comm.Isend(send_obj, dest=dest, tag=tag)]
        return Transfer(requests, send, received, recv,
                        self.timeout, f"context-parallel ring: {what} from rank {source}")
