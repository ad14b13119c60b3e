"""Pieces of ``perf/gpu_check.py``'s steps: commands under a deadline (a timed-out
launch is ended with its whole process group, so no rank keeps the GPU's memory), one
training run of a recipe and what its run folder says (tokens/s, MFU, phases, memory),
the measured peak against the performance model's (``hpctrain.scaling.rank_memory``).
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from perf.common import mpiexec, run
from perf.gpu_verdict import FAILED, OK
from hpctrain.sizes import GiB, MiB

OOM_WORDS = ("out of memory", "OutOfMemoryError")
PEAK_LINE = re.compile(r"device: [\d.]+ GiB allocated, ([\d.]+) GiB peak")
QUIET = ["--train.eval_interval=0", "--train.ckpt_interval=0", "--train.final_eval=false",
         "--train.save_checkpoint=false", "--train.progress=false", "--train.sample_tokens=0"]
"""What every measured run leaves out: evaluation, checkpoints, the progress bar."""


@dataclass
class Context:
    """What every step is given: the device, the data, a scratch folder, the step's
    deadline (``time.monotonic()``) and the sections of the steps before it."""
    device: str
    dry: bool
    gpt2: Path
    """GPT-2 tokens (the small char file in a dry run)."""
    small: Path
    """Character tokens for the small equivalence runs."""
    out: Path
    deadline: float = float("inf")
    sections: dict = field(default_factory=dict)

    def left(self, cap: float = float("inf")) -> float:
        """Seconds to the step's deadline, at most ``cap``."""
        return max(0.0, min(cap, self.deadline - time.monotonic()))


def hpctrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpctrain", *args]


def device_peak_gib(log: str) -> float | None:
    """The device allocator's peak after the first step, from the trainer's memory line
    (None on the host and the fake device, which keep no such count)."""
    m = PEAK_LINE.search(log)
    return float(m.group(1)) if m else None


def losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step, from ``metrics.jsonl`` (the steps it logged)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if "loss" in r and "step" in r and r.get("loss") is not None:
            out[int(r["step"])] = float(r["loss"])
    return out


def train(ctx: Context, name: str, recipe: str, overrides: list[str], *,
          data: Path | None = None, log_interval: int = 10, cap: float = 600) -> dict:
    """One run of ``recipe`` on one rank of ``ctx.device`` under ``--train.out_dir`` =
    ``ctx.out/name``; the facts of its ``summary.json`` and log, ``status`` ok, or FAILED
    with ``oom`` (the device ran out of memory), ``timed_out``, and ``refusal`` (the
    message of a run refused with exit 2: a bad option, or what this node cannot do)."""
    run_dir = ctx.out / name
    args = [f"--data.path={data or ctx.gpt2}", f"--train.out_dir={run_dir}",
            f"--train.device={ctx.device}", f"--train.log_interval={log_interval}",
            *QUIET, *overrides]
    rc, text = run(mpiexec(1, *hpctrain("train", recipe, *args)), ctx.left(cap))
    summary_path = run_dir / "summary.json"
    if rc != 0 or not summary_path.exists():
        oom, line = any(w in text for w in OOM_WORDS), refusal_line(text)
        why = "out of memory" if oom else "timed out" if rc == 124 else f"exit {rc}: {line}"
        out = {"status": FAILED, "exit": rc, "error": why, "tail": text[-2500:], "oom": oom,
               "timed_out": rc == 124}
        return {**out, "refusal": line} if rc == 2 else out
    summary = json.loads(summary_path.read_text())
    return {"status": OK, **facts(summary, text),
            **memory_vs_formula(summary, device_peak_gib(text), data or ctx.gpt2),
            "losses": losses(run_dir), "run_dir": str(run_dir)}


def refusal_line(text: str) -> str:
    """The message a refused run printed: its last line naming an error, else its last
    line (an MPI launcher's own lines about the exit come after it)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if "error" in ln.lower() and "mpi" not in ln.lower()]
    return (named or lines or [""])[-1][:500]


def facts(summary: dict, log: str) -> dict:
    """Tokens per step, the median step after warm-up, tokens/s at that pace (what MFU is
    counted from), MFU against the device's peak, phases and model-state memory."""
    cfg = summary["config"]
    tokens_per_step = cfg["train"]["batch_size"] * cfg["model"]["block_size"]
    timing = summary.get("timing") or {}
    step_ms = timing.get("step_ms_median") or summary.get("step_ms_median")
    steady = tokens_per_step / (step_ms / 1e3) if step_ms else None
    peak = summary.get("peak") or {}
    tflops = peak.get("tflops")
    mfu = summary["flops_per_token"] * steady / (tflops * 1e12) if tflops and steady else None
    return {"steps": summary["steps"], "tokens_per_step": tokens_per_step,
            "step_ms_median": step_ms, "tokens_per_s_steady": steady,
            "tokens_per_s_with_compile": summary.get("tokens_per_s"), "mfu": mfu,
            "peak": peak, "phases_ms": timing.get("phases_ms"), "clock": timing.get("clock"),
            "memory_per_rank": summary.get("memory_per_rank"),
            "device_memory": [ln for ln in log.splitlines() if "device:" in ln][:1]}


def memory_vs_formula(summary: dict, measured_gib: float | None, data: Path) -> dict:
    """The performance model's bytes for this run's rank (``rank_memory_terms``: model
    state, activations, logits, buffers; no base, which the allocator's count leaves out
    too) and the measured peak's ratio to it."""
    try:
        terms = formula_terms(summary["config"], summary.get("world_size", 1), data)
    except Exception as e:  # the comparison is a finding, never the run's failure
        return {"memory": {"formula_error": f"{type(e).__name__}: {e}"}}
    total = sum(terms.values()) / GiB
    return {"memory": {"measured_peak_gib": measured_gib, "formula_gib": round(total, 4),
                       "formula_terms_mib": {k: round(v / MiB, 1) for k, v in terms.items()},
                       "ratio": round(measured_gib / total, 3) if measured_gib else None}}


def formula_terms(cfg: dict, ranks: int, data: Path) -> dict[str, float]:
    """``rank_memory_terms`` for a resolved config (``summary.json``'s ``config``) on
    ``ranks`` ranks; a vocabulary of 0 is the dataset's, as in training."""
    from hpctrain.data.dataset import read_info
    from hpctrain.scaling.arrangement import Arrangement
    from hpctrain.scaling.models import ModelShape
    from hpctrain.scaling.rank_memory import rank_memory_terms

    m, p, t = cfg["model"], cfg["parallel"], cfg["train"]
    fields = {k: m[k] for k in ModelShape.__dataclass_fields__ if k in m}
    fields["vocab_size"] = fields.get("vocab_size") or read_info(data).vocab_size
    shape = ModelShape(**fields)
    arrangement = Arrangement(
        ranks=ranks, pp=p.get("pp", 1), zero=p.get("zero", 0),
        micro_batches=p.get("micro_batches", 1), global_batch=t["batch_size"],
        dtype=t["dtype"], schedule=p.get("schedule", "1f1b"),
        bucket_mb=p.get("bucket_mb", 25.0), recompute=m.get("recompute", "none"),
        recompute_every=m.get("recompute_every", 0), loss_chunk=m.get("loss_chunk", 0),
        tp=p.get("tp", 1), sequence_parallel=p.get("sequence_parallel", False),
        cp=p.get("cp", 1))
    return rank_memory_terms(shape, arrangement, flash_attention=True)
