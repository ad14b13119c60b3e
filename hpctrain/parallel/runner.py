"""How a step's micro-batches go forward and backward on this rank: the ``Runner``
interface and ``LocalRunner``.

``PipelineExecutor`` (``pipeline/executor.py``) runs a stage's share of a pipeline
schedule; ``LocalRunner`` below is the same interface for a model that is whole on every
rank (pp = 1), so a training step has one path::

    loss_sum = runner.train_step(xs, ys, loss_scale, engine.prepare_for_backward)
    loss = runner.forward_loss(x, y)     # evaluation; None on stages without the head
    runner.tie_weights()                 # after the optimizer step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from hpctrain.comm.device import Accelerator
from hpctrain.model.common.moe import set_loss_scale
from hpctrain.model.gpt import GPT
from hpctrain.parallel.pipeline.pass_times import PassTimes
from hpctrain.profiling import profile_range


@runtime_checkable
class RunnerStats(Protocol):
    bubble_s: float
    """Seconds blocked waiting for a neighbouring stage."""
    forward_s: float
    backward_s: float
    """Seconds in forward and backward passes (host clock), gradient hooks included.
    The step's phases come from the device layer's clock (``accel.clock``), whose spans
    these tallies are read from."""
    weight_s: float
    """Seconds in the weight-gradient passes of a backward split in two (zero-bubble
    schedules; ``backward_s`` is then the input-gradient passes); 0 where it is fused."""


@runtime_checkable
class Runner(Protocol):
    """What the trainer, the evaluator and the outputs use of a runner."""

    stats: RunnerStats
    order_times: PassTimes | None
    """The relative F, B, W times this rank's pass order was built for
    (``--parallel.pass_times``): the end of a run's pass-time advice compares the measured
    times against them. None where no order depends on them (a model whole on the rank)."""

    def train_step(self, xs: list, ys: list, loss_scale: float,
                   before_backward: Callable[[bool], None] | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch of ``xs``/``ys``; returns the summed
        loss (zero where this rank computes no loss). ``before_backward(last)`` runs
        before each micro-batch's backward."""

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The loss of one batch (evaluation); None on ranks that compute no loss."""

    def tie_weights(self) -> None:
        """After the optimizer step: bring copies of a tied weight up to date."""

    def describe(self) -> str | None:
        """A line for the start-up log, or None when there is nothing to say."""

    def whole_model_state(self, full: dict) -> dict | None:
        """The whole model's consolidated state from this rank's (``full``), on the rank
        that writes the outputs (world rank 0); None elsewhere. Collective."""

    def whole_model(self, state: dict) -> torch.nn.Module:
        """A whole GPT holding ``state`` (what ``whole_model_state`` returned)."""


@dataclass
class LocalStats:
    bubble_s: float = 0.0
    """Always zero: nothing waits for a neighbouring stage."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    """Seconds in backward passes, the gradient engine's hooks included."""
    weight_s: float = 0.0
    """Always zero: the backward is one pass."""


def assemble_gpt(cfg, state: dict, device) -> GPT:
    """A whole GPT of shape ``cfg`` holding the fp32 parameters of ``state`` (name ->
    {"param": tensor}, e.g. ``whole_model_state``'s), on ``device``: what samples on the
    rank that writes the outputs when no rank holds the whole model."""
    model = GPT(cfg)
    model.load_parameters({n: s["param"] for n, s in state.items()})
    return model.to(device)


class LocalRunner:
    def __init__(self, model: torch.nn.Module, accel: Accelerator | None = None, *,
                 whole: bool = True):
        """``accel``: the rank's device layer, which runs the backward passes (the fake
        device runs them on a thread of their own, as CUDA's autograd does). ``whole``:
        ``model`` is the whole GPT (False: this rank's tensor-parallel part of it)."""
        self.model = model
        self.accel = accel or Accelerator()
        self.stats = LocalStats()
        self.order_times = None  # one pass after another: no order to build
        self.whole = whole

    def train_step(self, xs: list, ys: list, loss_scale: float,
                   before_backward: Callable[[bool], None] | None = None) -> torch.Tensor:
        """Forward and backward of each micro-batch; returns the summed loss.
        ``before_backward(last)`` runs before each micro-batch (the gradient engine
        starts its reductions in the last one's backward pass)."""
        loss_sum = torch.zeros((), device=xs[0].device)
        set_loss_scale(self.model, loss_scale)
        clock = self.accel.clock  # the rank's phase clock (host time, or device events)
        for m, (x, y) in enumerate(zip(xs, ys)):
            if before_backward is not None:
                before_backward(m == len(xs) - 1)
            with clock.span("forward") as f, profile_range("forward"):
                loss = self.model(x, y)
            with clock.span("backward") as b, profile_range("backward"):
                self.accel.backward(loss * loss_scale)
            self.stats.forward_s += f.host_s
            self.stats.backward_s += b.host_s
            loss_sum += loss.detach()
        return loss_sum

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model(x, y)

    def tie_weights(self) -> None:
        """Nothing to do: the embedding and the head share one tensor."""

    def describe(self) -> str | None:
        return None

    def whole_model_state(self, full: dict) -> dict:
        """The whole model's consolidated state: this rank holds all of it already."""
        return full

    def whole_model(self, state: dict) -> torch.nn.Module:
        if self.whole:
            return self.model
        return assemble_gpt(self.model.cfg, state, next(self.model.parameters()).device)
