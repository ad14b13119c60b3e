"""The pass times a zero-bubble order is built for (``--parallel.pass_times``) against
those a run measured: whether an order built for the measured ones would idle less.

The orders (``zb_h1.py``, ``zbv.py``) are played with given relative
times of a chunk's forward (F), input-gradient (B) and weight-gradient (W) passes. They
default to F = B = W; where a run's passes differ (B slower than F on most hardware: the
attention's backward sits wholly in B), zbv's equal-time order idles more than one built
for the real times (``docs/design/pipeline.md``). The times are a setting (the config's
``pass_times``), not measured on the fly: every rank must build the same order, and an
order can change the sequence in which gradients add up (zbv's embedding and head share
one), so a run is reproduced, or resumed, bit for bit only with the same one.
"""

from __future__ import annotations

from hpctrain.parallel.pipeline import schedules as S
from hpctrain.parallel.pipeline.pass_times import PassTimes, text

IMPROVEMENT = 0.01
"""Idle share (of the step) an order for the measured times must save to be suggested."""


def advice(kind: str, n_stages: int, n_micro: int, used: PassTimes,
           seen: PassTimes) -> dict:
    """The simulator's idle share with the passes taking the ``seen`` times, for the order
    built for ``used`` and for one built for ``seen``; ``suggest`` holds the setting when
    that saves at least ``IMPROVEMENT`` of the step."""
    times = S.unit_times(n_stages, kind, seen)
    now = S.predicted_bubble(kind, n_stages, n_micro, times=times, order_times=used)
    better = S.predicted_bubble(kind, n_stages, n_micro, times=times, order_times=seen)
    return {"used": text(used), "measured": text(seen), "predicted_idle": now,
            "predicted_idle_for_measured": better,
            "suggest": text(seen) if now - better >= IMPROVEMENT else None}


def advice_line(kind: str, rec: dict) -> str:
    """One line for the end of a run."""
    head = (f"{kind} passes measured at F,B,W = {rec['measured']} (order built for "
            f"{rec['used']}; predicted idle {100 * rec['predicted_idle']:.1f}% of the step)")
    if rec["suggest"] is None:
        return head
    return (f"{head}: --parallel.pass_times={rec['suggest']} orders it for them "
            f"(predicted idle {100 * rec['predicted_idle_for_measured']:.1f}%)")
