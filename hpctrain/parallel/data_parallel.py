"""Data parallelism with a hand-written, bucketed gradient allreduce.

How a step's gradients move (after PyTorch DDP, Li et al., VLDB 2020):

1. Parameters are grouped into buckets in *reverse* registration order, because backward
   produces gradients roughly from the last layer to the first. The first bucket is small
   (1 MiB) so the first reduction starts early; the rest are capped at ``bucket_mb``.
2. Each bucket owns one flat fp32 buffer; every parameter's ``.grad`` is a view into it,
   so autograd accumulates straight into the buffer and nothing is copied.
3. A post-accumulate-grad hook counts the gradients a bucket still waits for. When the
   count reaches zero the bucket's reduction is started, strictly in bucket order (MPI
   needs every rank to start collectives in the same order). Every hook also tests the
   outstanding requests, which is what makes MPICH progress them during backward.
   A bucket's buffer never moves, so with an MPI-4 library the reduction is a persistent
   collective (``Allreduce_init`` once, ``Start`` each step: the schedule is built once);
   MPI-3 libraries (Cray MPICH 8, for one) get ``Iallreduce``.
4. ``finish()`` launches any bucket still pending (parameters that got no gradient) and
   waits for all reductions, under the watchdog deadline, before the optimizer step.

Averaging is folded into the loss: the trainer scales the loss by ``grad_scale`` (1/dp),
so the summed gradients are already the mean. With gradient accumulation, hooks do
nothing on all but the last micro-batch (``prepare_for_backward(sync=False)``).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer
from hpctrain.comm.watchdog import test_all, wait_all
from hpctrain.comm.world import World
from hpctrain.profiling import nvtx_range

MiB = 1 << 20


def plan_buckets(numels: list[int], elem_bytes: int, cap_bytes: int,
                 first_cap_bytes: int) -> list[list[int]]:
    """Split a sequence of tensors (given in reduction order) into buckets.

    A bucket is closed before it would exceed its cap; a tensor larger than the cap gets
    a bucket of its own. Returns lists of indices into ``numels``.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, first_cap_bytes
    for i, n in enumerate(numels):
        nbytes = n * elem_bytes
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class Bucket:
    """A flat fp32 gradient buffer; each parameter's ``.grad`` is a view into it."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], cuda_aware):
        self.index = index
        self.params = params
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel, dtype=torch.float32, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            if p.dtype != torch.float32:
                raise TypeError(f"bucketed allreduce expects fp32 parameters, got {p.dtype}")
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.buffer = MPIBuffer(self.flat, cuda_aware=cuda_aware)
        self.pending = len(params)
        self.request: MPI.Request | None = None
        self.persistent: MPI.Prequest | None = None

    def start_allreduce(self, comm: MPI.Comm) -> MPI.Request:
        obj = self.buffer.to_mpi()
        if self.persistent is not None:
            self.persistent.Start()
            return self.persistent
        return comm.Iallreduce(MPI.IN_PLACE, obj, op=MPI.SUM)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def bind_grads(self) -> None:
        for p, view in zip(self.params, self.views):
            p.grad = view


@dataclass
class CommStats:
    reductions: int = 0
    """Bucket reductions launched since construction."""
    bytes_reduced: int = 0
    wait_s: float = 0.0
    """Time spent in ``finish()`` waiting for reductions: communication not hidden."""


def persistent_collectives_supported(comm: MPI.Comm) -> bool:
    """True when the library implements MPI-4 persistent collectives. Collective."""
    if MPI.Get_version() < (4, 0) or not hasattr(comm, "Allreduce_init"):
        return False
    try:
        probe = comm.Allreduce_init(MPI.IN_PLACE, np.zeros(1), op=MPI.SUM)
    except (NotImplementedError, MPI.Exception):
        return False
    probe.Free()
    return True


def _free_requests(requests: list) -> None:
    if not MPI.Is_finalized():
        for req in requests:
            if req != MPI.REQUEST_NULL:
                req.Free()
    requests.clear()


class DataParallel:
    """Keeps ``model``'s gradients identical on every rank of ``world``."""

    def __init__(self, model: torch.nn.Module, world: World, *, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, persistent: bool | None = None):
        self.model = model
        self.world = world
        self.comm = world.comm
        self.size = world.size
        params = [p for p in model.parameters() if p.requires_grad]  # tied weights once
        order = params[::-1]
        groups = plan_buckets([p.numel() for p in order], 4, int(bucket_mb * MiB),
                              int(first_bucket_mb * MiB))
        self.buckets = [Bucket(i, [order[j] for j in g], world.cuda_aware)
                        for i, g in enumerate(groups)]
        self._bucket_of = {}
        for b in self.buckets:
            for p in b.params:
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        if persistent is None:
            persistent = self.size > 1 and persistent_collectives_supported(self.comm)
        self.persistent = persistent
        owned: list[MPI.Prequest] = []
        if persistent:
            for b in self.buckets:
                b.persistent = self.comm.Allreduce_init(MPI.IN_PLACE, b.buffer.obj, op=MPI.SUM)
                owned.append(b.persistent)
        # Free the persistent requests before MPI_Finalize (atexit runs this first).
        self._release = weakref.finalize(self, _free_requests, owned)
        self.stats = CommStats()
        self._sync = True
        self._next = 0
        self._inflight: list[MPI.Request] = []
        self.zero_grad()

    @property
    def grad_scale(self) -> float:
        """Multiply the loss by this: the allreduce sums, the scale turns it into a mean."""
        return 1.0 / self.size

    def grad_tensors(self) -> list[torch.Tensor]:
        """The flat gradient buffers (for clipping and norms: few large tensors)."""
        return [b.flat for b in self.buckets]

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat.zero_()
            b.bind_grads()  # in case anything set .grad to None

    def broadcast_parameters(self, root: int = 0) -> None:
        """Give every rank ``root``'s parameters, one bucket-sized broadcast at a time."""
        if self.size == 1:
            return
        with torch.no_grad():
            for b in self.buckets:
                torch.cat([p.detach().reshape(-1) for p in b.params], out=b.flat)
                req = self.comm.Ibcast(b.buffer.to_mpi(), root=root)
                wait_all([req], timeout=self.world.timeout,
                         what=f"broadcast of parameters (bucket {b.index})")
                b.buffer.from_mpi()
                for p, view in zip(b.params, b.views):
                    p.copy_(view)
                b.flat.zero_()

    def prepare_for_backward(self, sync: bool) -> None:
        """Call before each backward; ``sync=False`` accumulates locally (no communication)."""
        self._sync = sync
        if sync:
            for b in self.buckets:
                b.pending = len(b.params)
                b.request = None
            self._next = 0
            self._inflight = []

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync or self.size == 1:
            return
        bucket = self._bucket_of[param]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_in_order()
        elif self._inflight:
            test_all(self._inflight)  # drive progress of earlier buckets

    def _launch_in_order(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending <= 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def close(self) -> None:
        """Release MPI resources (persistent requests). Idempotent."""
        self._release()

    def _launch(self, b: Bucket) -> None:
        with nvtx_range(f"allreduce bucket {b.index}"):
            b.request = b.start_allreduce(self.comm)
        self._inflight.append(b.request)
        self.stats.reductions += 1
        self.stats.bytes_reduced += b.nbytes

    def finish(self) -> None:
        """Complete every bucket's reduction; gradients are then the global mean."""
        if not self._sync or self.size == 1:
            return
        for b in self.buckets[self._next:]:  # parameters that received no gradient
            b.pending = 0
        self._launch_in_order()
        t0 = time.perf_counter()
        with nvtx_range("allreduce wait"):
            wait_all(self._inflight, timeout=self.world.timeout,
                     what=f"gradient allreduce of {len(self.buckets)} bucket(s)")
        self.stats.wait_s += time.perf_counter() - t0
        for b in self.buckets:
            b.buffer.from_mpi()
        self._inflight = []
