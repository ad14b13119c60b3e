"""Run directories written by hand for the report's tests: the files a run leaves
(``metrics.jsonl``, ``summary.json``) with known numbers, no training needed."""

from __future__ import annotations

import json
from pathlib import Path


def step_record(step: int, elapsed: float, started_at: float, start_step: int,
                **extra) -> dict:
    return {"step": step, "loss": 4.0 - step / 100, "lr": 1e-3, "tokens_per_s": 1000.0 + step,
            "step_ms": 100.0, "grad_norm": 1.0, "tflops_per_device": 0.01, "mfu": 0.1,
            "data_ms": 1.0, "comm_wait_ms": 2.0, "bubble_ms": 0.0, "skipped_steps": 0,
            "elapsed_s": elapsed, "started_at": started_at, "start_step": start_step, **extra}


def segment(steps, started_at: float, start_step: int, seconds_per_step: float = 0.1,
            val_every: int = 20) -> list[dict]:
    return [step_record(s, (s - start_step) * seconds_per_step, started_at, start_step,
                        **({"val_loss": 3.9 - s / 100} if s % val_every == 0 else {}))
            for s in steps]


def summary(dp: int, pp: int, zero: int, steps: int) -> dict:
    world = dp * pp
    phases = {"data": 1.0, "forward": 30.0, "backward": 50.0, "hooks": 5.0, "wait": 4.0,
              "optimizer": 3.0, "bubble": 10.0 * (pp > 1), "other": 2.0}
    phases["step"] = sum(v for k, v in phases.items() if k != "hooks")
    by_rank = [{"params": 1 << 20, "grads": 1 << 20, "optimizer": 2 << 20, "comm_buffers": 0,
                "model_state": 4 << 20, "peak_rss_bytes": (400 + r) << 20}
               for r in range(world)]
    return {"status": "finished", "steps": steps, "world_size": world, "wall_s": 9.0,
            "final_val_loss": 3.0, "step_ms_median": 100.0, "tokens_per_s": 1000.0,
            "timing": {"phases_ms": phases}, "memory_by_rank": by_rank,
            "config": {"parallel": {"pp": pp, "tp": 1, "zero": zero},
                       "model": {"arch": "gpt", "n_layer": 2, "n_embd": 32}}}


def write_run(path: Path, records: list[dict], summary_record: dict | None = None,
              tail: str = "") -> Path:
    """A run directory; ``tail`` is appended after the last line as written (a record
    still being written has no newline)."""
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (path / "metrics.jsonl").write_text(text)
    if summary_record is not None:
        (path / "summary.json").write_text(json.dumps(summary_record))
    return path


def finished_run(path: Path, dp: int = 2, pp: int = 1, zero: int = 0) -> Path:
    records = segment(range(10, 101, 10), 1000.0, 0)
    records.append({"step": 100, "final_val_loss": 3.0, "elapsed_s": 10.5,
                    "started_at": 1000.0, "start_step": 0})
    return write_run(path, records, summary(dp, pp, zero, 100))


def resumed_run(path: Path) -> Path:
    """Steps 10..60 (logged, then stopped), resumed from the step-40 checkpoint to 100:
    steps 50 and 60 are logged twice."""
    first = segment(range(10, 61, 10), 1000.0, 0)
    second = segment(range(50, 101, 10), 5000.0, 40)
    return write_run(path, first + second, summary(1, 2, 0, 100))
