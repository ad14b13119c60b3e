"""The gradient-engine interface: what the trainer and checkpoints need from the part that
turns each rank's gradients into an optimizer step.

Three engines implement it: ``DataParallel`` (fp32, replicated, bucketed allreduce),
``MixedPrecisionDataParallel`` (bf16, fp32 master weights) and ``Zero`` (stages 1-3,
sharded AdamW). A step is the same for all: ``prepare_for_backward(last_micro)``,
backward (the runner), ``finish()``, ``norm = step(lr, clip)``, ``zero_grad()``.
``norm_comms`` and ``tp_comm`` finish the global gradient norm over pipeline stages and
the tensor-parallel group (whole copies counted 1/tp, ``local_norm_squares``). Under
expert parallelism ``experts`` (the ranks holding the same experts: ``ProcessGrid.
expert_world``) reduces the experts' gradients, and ``ep_comm`` (the expert group) slices
them: a replicated engine sums the norm over it, counting the other parameters 1/ep.
Every member, per engine: docs/design/training-step.md ("The gradient engine (``GradEngine``)").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from hpctrain.comm.mpi import MPI
from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.parallel.bucketing import CommStats
from hpctrain.parallel.memory import MemoryReport
from hpctrain.parallel.shards import ShardLayout
from hpctrain.parallel.tensor.split_state import TensorSplit

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")
"""What a checkpoint keeps per parameter: fp32 weight and AdamW's two moments."""


@dataclass
class BucketShard:
    """One ZeRO bucket's piece on this rank: which parameters lie where, and the fp32
    master weights and moments of this rank's shard (``STATE_KEYS``)."""
    names: list[str]
    shapes: list[list[int]]
    layout: ShardLayout
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


@runtime_checkable
class GradEngine(Protocol):
    """What callers use of a gradient engine: the trainer and runners (a step), the
    checkpoint code (state in and out), the outputs (whole parameters, memory)."""

    model: torch.nn.Module
    """What this rank holds (the whole GPT, or its pipeline stage)."""
    stats: CommStats
    """Reductions, bytes, gathers and the seconds spent waiting and in hooks."""
    tensor_split: TensorSplit
    """Which parameters hold a tensor-parallel slice, and how slices become whole."""

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

    def zero_grad(self) -> None:
        """Clear the gradients for the next step."""

    def state_shards(self) -> EngineState:
        """What this rank saves in a sharded checkpoint."""

    def load_shards(self, shards: list[dict], step: float) -> None:
        """Take back exactly what ``state_shards`` gave, from a checkpoint of this very
        layout (``param``, ``exp_avg``, ``exp_avg_sq`` arrays per bucket; collective)."""

    def load_full_state(self, full: dict[str, dict[str, torch.Tensor]], step: float) -> None:
        """Take this run's part of whole per-parameter tensors (``STATE_KEYS`` by name)."""

    def consolidated_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Whole fp32 parameters and moments by name, on every rank (collective)."""

    def gathered(self) -> contextlib.AbstractContextManager:
        """A context in which every parameter of ``model`` is whole (collective)."""

    def memory(self) -> MemoryReport:
        """Bytes of parameters, gradients, optimizer state and communication buffers."""

    def describe(self) -> str:
        """One line for the start-up log: buckets, how they are summed, the stage."""

    def close(self) -> None:
        """Release communicators and windows (collective; a second call does nothing)."""


def local_norm_squares(grads: list[torch.Tensor], duplicated: list[torch.Tensor],
                       copies: int) -> float:
    """This rank's share of the squared global gradient norm: the squares of ``grads``,
    where ``duplicated`` (views into them) are held whole by ``copies`` ranks that the
    norm also sums over (a tensor-parallel group), so that each copy counts 1/copies
    and the sum counts the parameter once. Each tensor's sum of squares is accumulated in
    fp64 on the device (an fp32 sum over a whole flat bucket of millions of elements
    drifts by parts per million); the float is the step's one wait for it."""
    squares = _squares(grads)
    if duplicated and copies > 1:
        squares = squares - (1.0 - 1.0 / copies) * _squares(duplicated)
    return float(squares)


def _squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64)
                        for t in tensors]).square().sum()


def norm_duplicates(grads: list[tuple[torch.Tensor, torch.Tensor]], split: TensorSplit
                    ) -> tuple[list[torch.Tensor], int]:
    """For ``local_norm_squares`` of an engine that holds whole gradients: of
    ``grads`` ((gradient, its parameter) pairs), those every rank of ``split.norm_comm``
    holds alike, and how many ranks that is (the parameters not tensor-parallel split;
    under expert parallelism, those that are not experts)."""
    from hpctrain.parallel.experts.apply import is_expert
    from hpctrain.parallel.tensor.layers import is_split

    sliced = is_expert if split.experts is not None else is_split
    return [g for g, p in grads if not sliced(p)], split.copies


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
