"""A pipeline chunk's three passes, forward (F), input gradient (B) and weight gradient
(W), and ``PassTimes``: their relative times, which a zero-bubble order is built for
(``zb_h1.py``, ``zbv.py``; ``--parallel.pass_times``, docs/design/pipeline.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FORWARD, BACKWARD, WEIGHT = "forward", "backward", "weight"
MAX_RATIO = 1000
"""Pass times further apart than this are refused (a slip, not a measurement)."""
GRID = 20
"""Pass times are played in whole steps of 1/GRID of a forward: exact arithmetic, so every
rank builds the same order."""


@dataclass(frozen=True)
class PassTimes:
    """Relative times of a model chunk's forward, input-gradient (B) and weight-gradient
    (W) passes, which a zero-bubble order is built for."""
    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0

    def __post_init__(self):
        times = (self.forward, self.backward, self.weight)
        if not all(math.isfinite(t) and t > 0 for t in times) or \
                max(times) > MAX_RATIO * min(times):
            raise ValueError(f"pass times are positive and within {MAX_RATIO}x of each "
                             f"other, not {self}")

    def steps(self, first_chunk: bool = False) -> dict[str, int]:
        """Whole time steps of each pass (F = GRID). The model's first chunk has no input
        gradient to compute, so its B is empty and its W the whole backward."""
        b, w = (max(1, round(GRID * t / self.forward)) for t in (self.backward, self.weight))
        return {FORWARD: GRID, BACKWARD: 0, WEIGHT: b + w} if first_chunk else \
            {FORWARD: GRID, BACKWARD: b, WEIGHT: w}


EQUAL = PassTimes()


def text(times: PassTimes) -> str:
    """The ``--parallel.pass_times`` value of ``times``, relative to the forward."""
    return ",".join(f"{x / times.forward:.3g}" for x in (times.forward, times.backward,
                                                        times.weight))


def measured(forward_s: float, backward_s: float, weight_s: float) -> PassTimes | None:
    """Relative times from the seconds a stage spent in its F, B and W passes (all its
    chunks and micro-batches together); None without all three."""
    if min(forward_s, backward_s, weight_s) <= 0:
        return None
    return PassTimes(1.0, backward_s / forward_s, weight_s / forward_s)
