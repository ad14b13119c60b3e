"""The learning-rate schedule: linear warm-up, then cosine decay, warmup-stable-decay or a
constant rate. Each is a pure function of the step, so a resumed run continues it exactly."""

from __future__ import annotations

import math

from hpctrain.config import OptimConfig


def learning_rate(step: int, cfg: OptimConfig, max_iters: int) -> float:
    """Linear warm-up to ``lr``, then down to ``min_lr`` at ``lr_decay_iters`` (or
    ``max_iters``): along a cosine (Loshchilov & Hutter 2017), or, for ``wsd``, held at
    ``lr`` and then linear over the last ``decay_fraction`` of the steps after the warm-up
    (warmup-stable-decay, Hu et al. 2024: the decay can start from any stable step)."""
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / (cfg.warmup_iters + 1)
    decay_iters = cfg.lr_decay_iters or max_iters
    if step >= decay_iters:
        return cfg.min_lr
    after_warmup = max(1, decay_iters - cfg.warmup_iters)
    if cfg.schedule == "wsd":
        decay_steps = max(1, math.ceil(cfg.decay_fraction * after_warmup))
        left = decay_iters - step  # steps until the decay's end, >= 1 here
        if left >= decay_steps:
            return cfg.lr
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * left / decay_steps
    progress = (step - cfg.warmup_iters) / after_warmup
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
