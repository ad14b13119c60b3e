"""A mixture-of-experts model's shape, without torch: which blocks route their tokens to
experts, how wide the experts are, and what they count (total parameters, and the
parameters one token works with: the active ones that set the FLOPs).

A MoE block replaces its MLP by ``moe_experts`` routed experts (each token picks
``moe_top_k``) and ``moe_shared`` shared experts every token passes through (DeepSeekMoE,
Dai et al. 2024), plus a router. ``GPTConfig`` holds the fields; the torch layer is
``common/moe.py``; docs/design/moe.md.
"""

from __future__ import annotations

import dataclasses

ROUTERS = ("softmax", "sigmoid")
"""How the router turns its logits into scores (``moe_router``): a softmax over the
experts (Switch, Mixtral, Qwen-MoE) or a sigmoid per expert (DeepSeek-V3)."""


def is_moe_block(cfg, index: int) -> bool:
    """Whether block ``index`` (0-based, of the whole model) is a MoE block: every
    ``moe_every``-th (blocks N-1, 2N-1, ..., as Qwen-MoE's ``decoder_sparse_step``)."""
    n = cfg.moe_every
    return cfg.moe_experts > 0 and index % n == n - 1


def moe_blocks(cfg) -> int:
    """How many blocks are MoE blocks."""
    return sum(is_moe_block(cfg, i) for i in range(cfg.n_layer))


def expert_hidden(cfg) -> int:
    """One expert's hidden width (``moe_ffn_hidden``; 0 = the dense MLP's)."""
    return cfg.moe_ffn_hidden or cfg.ffn_hidden


def shared_experts_config(cfg):
    """The dense MLP the shared experts are: ``cfg`` with an MLP as wide as
    ``moe_shared`` experts and no MoE fields (the family builds it as its MLP, and
    tensor parallelism splits it as one)."""
    return dataclasses.replace(cfg, ffn_hidden=cfg.moe_shared * expert_hidden(cfg),
                               moe_experts=0, moe_shared=0, moe_shared_gate=False)


def expert_params(cfg) -> int:
    """Parameters of one expert: the family's MLP matrices, no biases."""
    return cfg.family.mlp_matrices * cfg.n_embd * expert_hidden(cfg)


def moe_mlp_params(cfg, active: bool = False) -> int:
    """Parameters of a MoE block's MLP part: the router, the routed experts (only the
    ``moe_top_k`` a token uses when ``active``), the shared experts and their gate."""
    routed = cfg.moe_top_k if active else cfg.moe_experts
    n = cfg.moe_experts * cfg.n_embd + (routed + cfg.moe_shared) * expert_params(cfg)
    return n + (cfg.n_embd if cfg.moe_shared_gate else 0)


def check_moe(cfg) -> None:
    """ValueError naming the field to change when the MoE fields do not fit together."""
    if cfg.moe_experts == 0:
        if cfg.moe_shared or cfg.moe_shared_gate:
            raise ValueError("moe_shared and moe_shared_gate belong to MoE blocks: set "
                             "moe_experts > 0, or leave them at 0 / false")
        return
    if cfg.moe_router not in ROUTERS:
        raise ValueError(f"moe_router={cfg.moe_router!r} is not one of {', '.join(ROUTERS)}")
    if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        raise ValueError(f"moe_top_k={cfg.moe_top_k} must be between 1 and moe_experts="
                         f"{cfg.moe_experts} (each token picks that many experts)")
    if cfg.moe_shared_gate and not cfg.moe_shared:
        raise ValueError("moe_shared_gate gates the shared experts: set moe_shared > 0 too")
    if cfg.moe_every > cfg.n_layer:
        raise ValueError(f"moe_every={cfg.moe_every} exceeds n_layer={cfg.n_layer}: no block "
                         "would be a MoE block; use moe_every <= n_layer")
