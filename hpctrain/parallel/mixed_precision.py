"""Replicated data parallelism in bf16: every rank holds every parameter, computes in
bf16, keeps fp32 master weights and Adam moments, and sums fp32 gradients.

This is the ZeRO engine at level 0 (``zero/``), on purpose: level 0 is the layout in
which nothing is sharded, and what bf16 needs beyond ``DataParallel`` is exactly what
the ZeRO engine has for every level: parameters as bf16 views of flat buffers, fp32
"main gradient" buffers that gradient hooks add autograd's bf16 gradients into, and fp32
master weights that the optimizer updates and rounds back into the bf16 parameters.
Writing it again beside ``DataParallel`` would duplicate that machinery; this class
names the layout and says what it is in the start-up line.
"""

from __future__ import annotations

import torch

from hpctrain.comm.mpi import MPI
from hpctrain.comm.world import World
from hpctrain.parallel.zero import Zero


class MixedPrecisionDataParallel(Zero):
    """bf16 compute, replicated parameters, fp32 master weights and reductions."""

    def __init__(self, model: torch.nn.Module, world: World, optim_cfg, *,
                 dtype: str = "bf16", bucket_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 norm_comms: tuple = (), tp_comm: MPI.Comm | None = None,
                 experts: World | None = None, ep_comm: MPI.Comm | None = None):
        super().__init__(model, world, optim_cfg, level=0, dtype=dtype, bucket_mb=bucket_mb,
                         first_bucket_mb=first_bucket_mb, norm_comms=norm_comms,
                         tp_comm=tp_comm, experts=experts, ep_comm=ep_comm)

    def describe(self) -> str:
        summed = " summed by MPI Iallreduce" if self.size > 1 else ""
        if self.experts is not None:
            summed += f", experts reduced over {self.experts.size} rank(s)"
        return (f"{len(self.buckets)} gradient bucket(s){summed}, replicated "
                "parameters with fp32 master weights")
