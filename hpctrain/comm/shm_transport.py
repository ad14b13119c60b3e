"""``ShmTransport`` (``--comm.transport=shm``): MPI, except that CPU gradient buckets are
summed in the node's shared memory (``shm_allreduce.py``: the window, the phases, and
when it can work).
"""

from __future__ import annotations

import torch

from hpctrain.comm.buffers import MPIBuffer
from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import GPUAwareness
from hpctrain.comm.mpi import MPI
from hpctrain.comm.shm_allreduce import SharedMemoryAllreduce, ShmReduction
from hpctrain.comm.transport import MPITransport


class ShmTransport(MPITransport):
    """The transport whose allreduce sums CPU gradient buckets through the node's shared
    memory (``SharedMemoryAllreduce``); every other operation is MPI's, on the same
    memory. It allocates the buckets: reduction buffers must be its ``flat(i)``.
    Collective over ``comm`` (every rank passes the same bucket sizes)."""

    name = "shm"

    def __init__(self, comm: MPI.Comm, accel: Accelerator, aware: GPUAwareness,
                 numels: list[int], *, node_comm: MPI.Comm | None = None):
        super().__init__(comm, accel, aware)
        self.arena = SharedMemoryAllreduce(comm, numels, node_comm=node_comm)
        self._buckets: dict[int, int] = {}  # id of a bucket's buffer -> bucket index

    @property
    def across_nodes(self) -> bool:
        """Whether slices are also summed between nodes (over MPI, while polled)."""
        return self.arena.cross is not None

    def flat(self, bucket: int) -> torch.Tensor:
        """This rank's bucket ``bucket`` in the shared window (give it to the gradients)."""
        return self.arena.flat(bucket)

    def buffer(self, tensor, *, reduction: bool = False, raw: bool = False) -> MPIBuffer:
        buf = super().buffer(tensor, reduction=reduction, raw=raw)
        if reduction:
            mine = [f.data_ptr() for f in self.arena.flats[self.arena.local]]
            if tensor.data_ptr() not in mine:
                raise ValueError("the shared-memory transport sums only its own buckets "
                                 "(flat(i))")
            self._buckets[id(buf)] = mine.index(tensor.data_ptr())
        return buf

    def allreduce(self, buf: MPIBuffer) -> ShmReduction:
        return self.arena.start(self._buckets[id(buf)])

    def close(self) -> None:
        """Free the window and its communicators (collective over the node; idempotent)."""
        self._buckets.clear()
        self.arena.close()
        super().close()
