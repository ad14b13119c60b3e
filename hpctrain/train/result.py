"""What a run returns and what each log step records (``metrics.jsonl``, the progress bar)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.train.metrics import Peak


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    """Mean loss over the whole global batch, one per step."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Periodic validation estimates by step."""
    final_val_loss: float | None = None
    """Loss over the final evaluation's windows (the whole validation split, or an even
    spread of --train.final_eval_batches x 64 of them)."""
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    """Seconds each step waited for its batch (the reader thread was behind)."""
    comm_times: list[float] = field(default_factory=list)
    """Seconds each step waited for gradient reductions after backward (not hidden)."""
    bubble_times: list[float] = field(default_factory=list)
    """Seconds each step's pipeline stage sat idle waiting for a neighbour (pp > 1)."""
    phases: list[dict] = field(default_factory=list)
    """Each step's seconds per phase (``timing.PHASES``)."""
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    stopped_at: int | None = None
    """The step after which a scheduler's signal stopped training (None: it finished)."""


def step_record(step: int, loss: float, lr: float, tok_s: float, step_s: float, norm: float,
                data_s: float, wait_s: float, bubble_s: float, *, flops_per_token: float,
                peak: Peak, skipped: int) -> dict:
    """One ``metrics.jsonl`` line (times in ms, throughput per device: ranks sharing a
    device count as one)."""
    flops_per_s = flops_per_token * tok_s
    return {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tok_s,
            "step_ms": step_s * 1e3, "grad_norm": norm,
            "tflops_per_device": flops_per_s / peak.devices / 1e12,
            "mfu": peak.mfu(flops_per_s), "data_ms": data_s * 1e3,
            "comm_wait_ms": wait_s * 1e3, "bubble_ms": bubble_s * 1e3,
            "skipped_steps": skipped}


def logs_step(done: int, t, *, evaluates: bool, saves: bool, stops: bool) -> bool:
    """Whether the loop writes a metrics record after step ``done`` (``t``: the train
    config): every ``log_interval`` steps and at the last one, and whenever the step
    evaluates, saves a checkpoint or stops, so that those carry the training loss too."""
    return (done % t.log_interval == 0 or done == t.max_iters
            or evaluates or saves or stops)


def bar_text(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    skipped = f" | skipped {r['skipped_steps']}" if r["skipped_steps"] else ""
    return (f"loss {r['loss']:.4f} | {r['tokens_per_s'] / 1e3:.1f}k tok/s | "
            f"{r['tflops_per_device']:.3f} TFLOP/s/dev | MFU {mfu}{skipped}")


def add_steps(result: TrainResult, steps: list[dict], deadline) -> None:
    """Record the phase times of the steps the phase clock read (``PhaseClock.stop()``,
    ``flush()``: on a device, a step is read after the next one), and their durations
    in the time-limit guard (``deadline``: ``train/deadline.py``)."""
    for phases in steps:
        result.step_times.append(phases["step"])
        result.data_times.append(phases["data"])
        result.comm_times.append(phases["wait"])
        result.bubble_times.append(phases["bubble"])
        result.phases.append(phases)
        deadline.record_step(phases["step"])


class LogWindow:
    """The steps since the last log line. Their losses stay on each rank until the log
    step, where one small collective turns them into means over the whole global batch."""

    def __init__(self, world, loss_ranks: int, clock, deadline):
        """``loss_ranks``: ranks that compute each step's loss (``ProcessGrid``);
        ``clock``: the phase clock, whose unread steps ``flush`` records (with their
        durations in ``deadline``) so that the window's means hold its every step."""
        self.world, self.loss_ranks = world, loss_ranks
        self.clock, self.deadline = clock, deadline
        self.losses: list[torch.Tensor] = []
        self.restart()

    def restart(self) -> None:
        """Start timing the next window (after a checkpoint save, which is not a step)."""
        self.t0 = time.perf_counter()

    def flush(self, result: TrainResult) -> tuple[float, int, float, list[float]]:
        """Log step (collective): add the window's global losses to ``result``; returns
        (the last loss, steps, seconds, mean data / comm / bubble seconds per step)."""
        w, n = self.world, len(self.losses)
        elapsed = time.perf_counter() - self.t0
        add_steps(result, self.clock.flush(), self.deadline)
        local = torch.stack(self.losses).double().cpu().numpy()
        # Each replica's last stage holds its loss (on each of its tensor-parallel
        # ranks); the other stages add zeros.
        losses = allreduce_array(w.comm, local, timeout=w.timeout,
                                 what="loss reduction") / self.loss_ranks
        result.losses.extend(losses.tolist())
        self.losses = []
        means = [statistics.fmean(x[-n:]) for x in (result.data_times, result.comm_times,
                                                     result.bubble_times)]
        return float(losses[-1]), n, elapsed, means
