"""What to do when a step's gradient norm is NaN or inf (``--train.on_nonfinite``).

The norm is computed after the reductions, so it is the same number on every rank and
every rank decides alike; the engine has already skipped the update."""

from __future__ import annotations

import math
from pathlib import Path

from hpctrain.errors import NonFiniteError


class NonFiniteGuard:
    def __init__(self, policy: str, max_in_row: int, checkpoints: Path):
        self.policy, self.max_in_row, self.checkpoints = policy, max_in_row, checkpoints
        self.skipped = 0
        """Steps whose gradient norm was NaN or inf (skipped with on_nonfinite=skip)."""
        self.in_row = 0

    def check(self, norm: float) -> None:
        """Count a step's norm; raise when the policy says stop."""
        if math.isfinite(norm):
            self.in_row = 0
            return
        self.skipped += 1
        self.in_row += 1
        if self.policy == "abort":
            raise NonFiniteError(
                f"the gradient norm is {norm} (a NaN or inf loss or gradient); "
                "lower --optim.lr, keep --optim.grad_clip on, check the data, or pass "
                "--train.on_nonfinite=skip to skip such steps")
        if self.in_row >= self.max_in_row:
            kept = (f"the last good checkpoint ({self.checkpoints}) is kept: resume from it "
                    "with a lower --optim.lr" if (self.checkpoints / "latest").is_file()
                    else "no checkpoint was written; restart with a lower --optim.lr")
            raise NonFiniteError(
                f"{self.in_row} steps in a row had a NaN or inf gradient norm "
                f"(--train.max_skipped_steps={self.max_in_row}): training has diverged; "
                f"{kept}")
