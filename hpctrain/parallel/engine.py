"""The gradient-engine interface: what the trainer and checkpoints need from the part that
turns each rank's gradients into an optimizer step.

Two engines implement it: ``DataParallel`` (fp32, replicated parameters, bucketed
allreduce, one fused AdamW) and ``Zero`` (stages 0-3, fp32 or bf16, sharded AdamW). A step
is the same for both::

    engine.prepare_for_backward(last_micro)   # before each micro-batch's backward
    ... backward passes (the runner) ...
    engine.finish()                           # every reduction complete
    norm = engine.step(lr, clip)              # global norm, clip, update (skipped if inf/NaN)
    engine.zero_grad()

``norm_comms`` let an engine finish the global gradient norm over ranks that hold other
parameters (the pipeline's stages): the squares are summed over each of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
from mpi4py import MPI

from hpctrain.comm.collectives import allreduce_array
from hpctrain.parallel.memory import MemoryReport

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""What a checkpoint keeps per parameter: fp32 weight and AdamW's two moments."""


@dataclass
class BucketShard:
    """One ZeRO bucket's piece on this rank: which parameters lie where, and the fp32
    master weights and moments of this rank's shard (``STATE_KEYS``)."""
    names: list[str]
    shapes: list[list[int]]
    layout: object  # parallel.shards.ShardLayout
    tensors: dict[str, torch.Tensor]


@dataclass
class EngineState:
    """What an engine holds for a checkpoint, independent of the file format.

    ``kind`` "replicated": ``params`` maps every parameter name to its whole tensors (the
    same on every rank of the data-parallel group); "zero": ``buckets`` hold this rank's
    shards."""
    kind: str
    step: float
    """AdamW's step count."""
    params: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    buckets: list[BucketShard] = field(default_factory=list)


class GradEngine(Protocol):
    model: torch.nn.Module
    stats: object  # bucketing.CommStats: reductions, bytes, wait_s

    @property
    def grad_scale(self) -> float:
        """Multiply the loss by this (1/dp: the reductions sum, the scale makes a mean)."""

    def prepare_for_backward(self, last_micro: bool) -> None:
        """Before each micro-batch's backward; reductions start in the last one (stages 2-3
        of ZeRO reduce every micro-batch)."""

    def finish(self) -> None:
        """Wait for every reduction of this step (under the watchdog's deadline)."""

    def step(self, lr: float, clip: float) -> float:
        """Global gradient norm; clip to ``clip`` (0: off) and update unless the norm is
        NaN or inf (the same number on every rank, so every rank skips alike)."""

    def zero_grad(self) -> None: ...

    def state_shards(self) -> EngineState: ...

    def load_full_state(self, full: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Take this run's part of whole per-parameter tensors (``STATE_KEYS`` by name)."""

    def consolidated_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Whole fp32 parameters and moments by name, on every rank (collective)."""

    def gathered(self) -> contextlib.AbstractContextManager: ...

    def memory(self) -> MemoryReport: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def finish_norm(local_squares: float, comms: list[MPI.Comm], timeout: float) -> float:
    """The global L2 norm from this rank's sum of squares, adding the squares of the ranks
    in each of ``comms`` (ZeRO shards, pipeline stages)."""
    total = local_squares
    for comm in comms:
        if comm.Get_size() > 1:
            total = float(allreduce_array(comm, [total], timeout=timeout,
                                          what="gradient norm")[0])
    return total ** 0.5


@contextlib.contextmanager
def nothing_to_gather(model: torch.nn.Module):
    """``gathered()`` for engines whose parameters are whole on every rank."""
    yield model
