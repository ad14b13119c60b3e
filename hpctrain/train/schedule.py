"""The learning-rate schedule: linear warm-up, then cosine decay."""

from __future__ import annotations

import math

from hpctrain.config import OptimConfig


def learning_rate(step: int, cfg: OptimConfig, max_iters: int) -> float:
    """Linear warm-up to ``lr`` then cosine decay to ``min_lr`` (Loshchilov & Hutter 2017)."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or max_iters
    if step >= decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
