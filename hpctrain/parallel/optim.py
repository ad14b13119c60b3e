"""AdamW with decay/no-decay groups and global-norm clipping: the optimizer maths both
gradient engines share (the learning-rate schedule is the trainer's: train/schedule.py)."""

from __future__ import annotations

import torch

from hpctrain.config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or LayerNorm gains (as GPT-2/nanoGPT)."""
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights appear once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    """``cfg.name``'s optimizer over ``groups`` (each group sets its own weight decay)."""
    if cfg.name == "sgd":
        # No momentum and L2 decay folded into the gradient (torch's SGD): the update is
        # exactly lr x (gradient + decay x weight), which the tests use to see scale errors.
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=0.0)
    # The fused kernel updates all tensors in one pass per group (CPU and CUDA); it
    # keeps per-tensor Python overhead out of the short steps of small models.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=True)


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all gradient tensors (fp32 accumulation)."""
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(total_norm, max_norm: float):
    """Factor that brings a gradient of norm ``total_norm`` to at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``'s formula, so runs match plain PyTorch)."""
    coef = max_norm / (total_norm + 1e-6)
    return torch.clamp(coef, max=1.0) if isinstance(coef, torch.Tensor) else min(coef, 1.0)


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (no-op when below)."""
    torch._foreach_mul_(grads, clip_coefficient(total_norm, max_norm))
