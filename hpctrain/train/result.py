"""What a run returns and what each log step records (``metrics.jsonl``, the progress bar)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    """Mean loss over the whole global batch, one per step."""
    val_losses: dict[int, float] = field(default_factory=dict)
    """Periodic validation estimates by step."""
    final_val_loss: float | None = None
    """Loss over the whole validation split at the end."""
    step_times: list[float] = field(default_factory=list)
    data_times: list[float] = field(default_factory=list)
    """Seconds each step waited for its batch (the reader thread was behind)."""
    comm_times: list[float] = field(default_factory=list)
    """Seconds each step waited for gradient reductions after backward (not hidden)."""
    bubble_times: list[float] = field(default_factory=list)
    """Seconds each step's pipeline stage sat idle waiting for a neighbour (pp > 1)."""
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    stopped_at: int | None = None
    """The step after which a scheduler's signal stopped training (None: it finished)."""


def step_record(step: int, loss: float, lr: float, tok_s: float, step_s: float, norm: float,
                data_s: float, wait_s: float, bubble_s: float, *, flops_per_token: float,
                world_size: int, peak: float | None, skipped: int) -> dict:
    """One ``metrics.jsonl`` line (times in ms, throughput per device)."""
    tflops = flops_per_token * tok_s / world_size / 1e12
    return {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tok_s,
            "step_ms": step_s * 1e3, "grad_norm": norm, "tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None, "data_ms": data_s * 1e3,
            "comm_wait_ms": wait_s * 1e3, "bubble_ms": bubble_s * 1e3,
            "skipped_steps": skipped}


def bar_text(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    skipped = f" | skipped {r['skipped_steps']}" if r["skipped_steps"] else ""
    return (f"loss {r['loss']:.4f} | {r['tokens_per_s'] / 1e3:.1f}k tok/s | "
            f"{r['tflops_per_device']:.3f} TFLOP/s/dev | MFU {mfu}{skipped}")
