"""Where a step's time went: compute, exposed communication, pipeline bubble, data wait.

The phases of each step come from the device layer's one clock (``PhaseClock``,
``comm/phase_clock.py``: host time on the CPU, device events on a GPU); this module
summarises them. Scaling studies read these from ``summary.json``.
"""

from __future__ import annotations

import resource
import sys

import numpy as np

from hpctrain.comm.phase_clock import PARTS_OF_BACKWARD, PHASES

__all__ = ["PARTS_OF_BACKWARD", "PHASES", "peak_rss_bytes", "phase_medians",
           "summarize", "warmup_steps"]


def warmup_steps(n_steps: int) -> int:
    """Steps left out of timing summaries: allocator, caches and thread pools settle in
    the first few steps. A tenth of the run, at least 1 and at most 10."""
    return 0 if n_steps < 2 else min(10, max(1, n_steps // 10))


def summarize(step_s, data_s, comm_s, bubble_s) -> dict:
    """Median and p90 step time after warm-up and the mean share of each component."""
    step = np.asarray(step_s, dtype=float)
    skip = warmup_steps(len(step))
    if len(step) - skip < 1:
        return {}
    parts = {"data": np.asarray(data_s, float), "comm": np.asarray(comm_s, float),
             "bubble": np.asarray(bubble_s, float)}
    total = float(step[skip:].sum())
    shares = {k: float(v[skip:].sum()) / total for k, v in parts.items()}
    shares["compute"] = max(0.0, 1.0 - sum(shares.values()))
    return {"warmup_steps": skip, "measured_steps": len(step) - skip,
            "step_ms_median": 1e3 * float(np.median(step[skip:])),
            "step_ms_p90": 1e3 * float(np.percentile(step[skip:], 90)),
            "shares": shares}


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def phase_medians(phases: list[dict], skip: int) -> dict[str, float]:
    """Median milliseconds per step of each phase, after ``skip`` warm-up steps."""
    kept = phases[skip:] or phases
    if not kept:
        return {}
    return {k: 1e3 * float(np.median([p[k] for p in kept])) for k in (*PHASES, "step")}
