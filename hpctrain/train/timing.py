"""Where a step's time went: compute, exposed communication, pipeline bubble, data wait.

The trainer measures the last three directly (each is time spent blocked on something);
compute is the rest of the step. Scaling studies read these from ``summary.json``.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time

import numpy as np

PHASES = ("data", "forward", "backward", "hooks", "wait", "optimizer", "bubble", "other")
"""Where a step's time goes. ``hooks`` is the part of ``backward`` that gradient hooks
spend on reductions (launching, polling; the shared-memory sums across nodes); ``wait``
is ``finish()`` completing them after backward (on one node with shared memory, all the
sums: there are no hooks there); ``other`` is the rest of the step (loss bookkeeping,
zero_grad)."""
PARTS_OF_BACKWARD = ("hooks", "weight")
"""Per-step entries that are a part of ``backward``, not beside it: the hooks, and a
zero-bubble schedule's W passes (``weight``; recorded per step, not in ``PHASES``)."""


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


class PhaseClock:
    """Each step's seconds per phase (``PHASES``), from the cumulative counters of the
    runner (forward, backward, bubble) and the gradient engine (hooks, wait), and the
    trainer's own timed sections (``with clock.timing("data")``)."""

    def __init__(self, runner, engine):
        self.runner, self.engine = runner, engine
        self.own = {"data": 0.0, "optimizer": 0.0}

    @contextlib.contextmanager
    def timing(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.own[phase] += time.perf_counter() - t0

    def _counters(self) -> dict[str, float]:
        r, e = self.runner.stats, self.engine.stats
        return {"forward": r.forward_s, "backward": r.backward_s + r.weight_s,
                "weight": r.weight_s, "bubble": r.bubble_s,
                "hooks": e.hook_s, "wait": e.wait_s, **self.own}

    def start(self) -> None:
        self._t0, self._c0 = time.perf_counter(), self._counters()

    def stop(self) -> dict[str, float]:
        """Seconds of each phase since ``start()``, and ``step`` in all."""
        step = time.perf_counter() - self._t0
        now = self._counters()
        phases = {k: now[k] - self._c0[k] for k in now}
        phases["other"] = step - sum(v for k, v in phases.items()
                                     if k not in PARTS_OF_BACKWARD)
        return {**phases, "step": step}


def phase_medians(phases: list[dict], skip: int) -> dict[str, float]:
    """Median milliseconds per step of each phase, after ``skip`` warm-up steps."""
    kept = phases[skip:] or phases
    if not kept:
        return {}
    return {k: 1e3 * float(np.median([p[k] for p in kept])) for k in (*PHASES, "step")}
