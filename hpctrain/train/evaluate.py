"""Validation losses: a periodic estimate over fixed batches, and the final evaluation
over windows spread evenly across the split (all of them when the split is small or
``--train.final_eval_batches=0``). Both are collective and return the same number on
every rank."""

from __future__ import annotations

import torch

from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.data.loader import BatchLoader
from hpctrain.progress import Progress

FULL_EVAL_ROWS = 64
"""Windows per forward pass in both evaluations. Training bounds its memory with
micro-batches; evaluation by this: a rank's share of a periodic estimate's batch is the
global batch over the replicas (120 rows of GPT-2 124M at 480 x 1024 on 4 GPUs), whose
fp32 logits alone would take 25 GB."""


class Evaluator:
    """``runner.forward_loss`` returns a loss only where the loss is computed (the last
    pipeline stage of each replica); the others add zeros to the sums."""

    def __init__(self, model: torch.nn.Module, runner, batches: BatchLoader, world,
                 train, loss_ranks: int | None = None):
        """``train``: the run's ``TrainConfig`` (``eval_iters``, ``final_eval_batches``,
        ``progress``); ``loss_ranks``: how many ranks compute each batch's loss
        (``ProcessGrid``; default one per data-parallel replica)."""
        self.model, self.runner, self.batches = model, runner, batches
        self.world, self.eval_iters = world, train.eval_iters
        self.final_windows = train.final_eval_batches * FULL_EVAL_ROWS
        self.progress = train.progress and world.is_root
        self.loss_ranks = loss_ranks or batches.dp
        self.covered = ""
        """What the last final evaluation covered, for the log."""

    def _sum(self, values, what: str):
        return allreduce_array(self.world.comm, values, timeout=self.world.timeout, what=what)

    def _loss(self, x, y) -> float | None:
        loss = self.runner.forward_loss(x, y)
        return None if loss is None else loss.item()

    @torch.no_grad()
    def estimate(self, stop=None) -> float | None:
        """Mean loss over ``eval_iters`` fixed global batches of the validation split;
        None when ``stop`` (the run's ``StopAgreement``) agrees on a stop: thousands of
        batches outlast a scheduler's grace period, so the ranks ask before each forward
        pass (``StopAgreement.poll``, the training loop's agreement), all at the same
        pass, and abandon the evaluation together."""
        self.model.eval()
        try:
            local = 0.0
            for k in range(self.eval_iters):
                x, y = self.batches.val(k)
                for xs, ys in zip(x.split(FULL_EVAL_ROWS), y.split(FULL_EVAL_ROWS)):
                    if _stopping(stop):
                        return None
                    local += (self._loss(xs, ys) or 0.0) * len(xs) / len(x)  # batch mean
        finally:
            self.model.train()
        total = self._sum([local / self.eval_iters], "validation estimate")
        return float(total[0]) / self.loss_ranks  # the same loss from each of them

    @torch.no_grad()
    def final_loss(self, stop=None) -> float | None:
        """Token-weighted loss over the validation windows ``val_windows`` chooses (every
        one, or ``final_eval_batches`` x 64 spread over the split); None when ``stop``
        agrees on a stop, asked before each forward pass as in ``estimate``."""
        self.model.eval()
        starts, mine, every = self.batches.val_windows(self.final_windows)
        self.covered = (f"the whole split ({every:,} windows)" if len(starts) == every else
                        f"{len(starts):,} of the split's {every:,} windows, spread evenly "
                        "(--train.final_eval_batches)")
        # Every rank runs the same number of forward passes (ZeRO-3 gathers parameters
        # inside forward, collectively); a rank out of windows runs one and ignores it.
        most = -(-len(starts) // self.batches.dp)
        total, count = 0.0, 0
        bar = Progress(-(-most // FULL_EVAL_ROWS), "final eval", enabled=self.progress)
        try:
            for i in range(0, most, FULL_EVAL_ROWS):
                if _stopping(stop):
                    return None
                rows = mine[i:i + FULL_EVAL_ROWS]
                x, y = self.batches.rows("val", rows if len(rows) else starts[:1])
                loss = self._loss(x, y)
                if len(rows) and loss is not None:
                    total += loss * y.numel()
                    count += y.numel()
                bar.update(1)
        finally:
            bar.close()
            self.model.train()
        sums = self._sum([total, count], "final validation loss")
        return float(sums[0] / sums[1])


def _stopping(stop) -> bool:
    """Whether the ranks agree on a stop before this forward pass (collective)."""
    return stop is not None and stop.poll()
