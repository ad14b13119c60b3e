"""The collectives of one tensor-parallel group, as the layers need them: blocking, out
of place, on whole activations.

A tensor-parallel layer cannot go on before its collective is done (the next matrix
multiply reads the sum), so ``allreduce``, ``all_gather`` and ``reduce_scatter`` return
their result. They run over MPI or the device library (``--comm.collectives``), and each
is a torch custom operator (``hpctrain::tp_*``) so that ``torch.compile`` keeps a block
with its collectives in one graph. Transports, bf16 sums and how an operator finds its
group: ``docs/design/tensor-parallel.md``.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.mpi import MPI
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import World


GROUPS: "weakref.WeakValueDictionary[int, TensorParallelGroup]" = weakref.WeakValueDictionary()
"""Every live group of this process by its key, for the operators below."""
_NEXT_KEY = itertools.count()


class TensorParallelGroup:
    """The ranks that share each layer's weights (adjacent ranks: one node)."""

    def __init__(self, comm: MPI.Comm, world: World):
        """``comm``: the group's communicator; ``world``: the run's (device, MPI's GPU
        awareness, deadline, and which collectives move tensors)."""
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.accel, self.aware, self.timeout = world.accel, world.gpu_aware, world.timeout
        self.process_group = None
        self.backend = "mpi"
        if world.collectives == "xccl" and self.size > 1:
            from hpctrain.comm import device_collectives

            self.process_group = device_collectives.group_for(comm, "tensor")
            self.backend = torch.distributed.get_backend(self.process_group)
        self.key = next(_NEXT_KEY)
        GROUPS[self.key] = self

    def allreduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the group (a new tensor, ``t``'s dtype)."""
        return t if self.size == 1 else torch.ops.hpctrain.tp_allreduce(t, self.key)

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim``, in rank order."""
        return t if self.size == 1 else torch.ops.hpctrain.tp_all_gather(t, dim, self.key)

    def reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The sum of ``t`` over the group, cut into ``size`` equal slices along ``dim``;
        this rank's slice."""
        return t if self.size == 1 else torch.ops.hpctrain.tp_reduce_scatter(t, dim, self.key)

    def _sum_dtype(self, dtype: torch.dtype) -> torch.dtype:
        native = self.backend in ("nccl", "xccl") and dtype == torch.bfloat16
        return dtype if native else torch.float32

    def _wait(self, req, what: str) -> None:
        wait_all([req], timeout=self.timeout, what=f"tensor-parallel {what}")

    def run_allreduce(self, t: torch.Tensor) -> torch.Tensor:
        work = _fresh(t, self._sum_dtype(t.dtype))
        if self.process_group is not None:
            torch.distributed.all_reduce(work, group=self.process_group)
        else:
            buf = MPIBuffer(work, self.accel, self.aware, reduction=True)
            self._wait(self.comm.Iallreduce(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM),
                       "allreduce")
            buf.complete()
        return work.to(t.dtype)

    def run_all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        t, dim = t.contiguous(), dim % t.dim()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        if self.process_group is not None:
            from hpctrain.comm.device_collectives import all_gather_into

            all_gather_into(out.view(-1), t.view(-1), self.process_group)
        else:
            send = MPIBuffer(t, self.accel, self.aware)
            recv = MPIBuffer(out, self.accel, self.aware)
            recv.prepare(send=False)  # only written: nothing to stage
            send_obj, recv_obj = to_mpi_all([send, recv])
            self._wait(self.comm.Iallgather(send_obj, recv_obj), "all-gather")
            recv.complete()
        return out.movedim(0, dim).flatten(dim, dim + 1).contiguous()

    def run_reduce_scatter(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        dim = dim % t.dim()
        # (..., size * n, ...) -> (size, ..., n, ...): each rank's slice contiguous
        work = _fresh(t.unflatten(dim, (self.size, -1)).movedim(dim, 0),
                      self._sum_dtype(t.dtype))
        if self.process_group is not None:
            from hpctrain.comm.device_collectives import reduce_scatter_into

            mine = reduce_scatter_into(work, self.process_group, self.rank)
        else:
            buf = MPIBuffer(work, self.accel, self.aware, reduction=True)
            self._wait(self.comm.Ireduce_scatter_block(MPI.IN_PLACE, buf.to_mpi(),
                                                       op=MPI.SUM), "reduce-scatter")
            buf.complete()
            mine = work[0]  # MPI_IN_PLACE: this rank's slice lands at the start
        return mine.to(t.dtype, copy=True)  # never a view of the work buffer


def _fresh(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous copy of ``t`` in ``dtype`` that the collective may overwrite (never
    ``t``'s own memory, which autograd may still read)."""
    return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


@torch.library.custom_op("hpctrain::tp_allreduce", mutates_args=())
def _allreduce_op(t: torch.Tensor, group: int) -> torch.Tensor:
    return GROUPS[group].run_allreduce(t)


@_allreduce_op.register_fake
def _(t, group):
    return torch.empty_like(t)


@torch.library.custom_op("hpctrain::tp_all_gather", mutates_args=())
def _all_gather_op(t: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    return GROUPS[group].run_all_gather(t, dim)


@_all_gather_op.register_fake
def _(t, dim, group):
    shape = list(t.shape)
    shape[dim] *= GROUPS[group].size
    return t.new_empty(shape)


@torch.library.custom_op("hpctrain::tp_reduce_scatter", mutates_args=())
def _reduce_scatter_op(t: torch.Tensor, dim: int, group: int) -> torch.Tensor:
    return GROUPS[group].run_reduce_scatter(t, dim)


@_reduce_scatter_op.register_fake
def _(t, dim, group):
    shape = list(t.shape)
    shape[dim] //= GROUPS[group].size
    return t.new_empty(shape)
