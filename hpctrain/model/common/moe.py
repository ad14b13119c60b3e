"""The mixture-of-experts layer a MoE block has in place of its MLP: a router, the routed
experts (``experts.py``) and optional shared experts.

Each token's router scores pick its ``moe_top_k`` experts; the token's copies are sorted
by expert, handed to ``dispatch`` (``local_dispatch`` here; under expert parallelism
``parallel/experts/`` sends them to the ranks that hold their experts and back), and
their outputs are summed back into the token, weighted by the normalised scores.
Dropless by default: every copy reaches its expert, so the layer computes the same on
any layout. The load-balancing loss is computed per sequence (so that it is the same
whatever the micro-batches and ranks a batch is cut into) and reaches the gradients
without passing through the blocks' outputs (``AddAuxiliaryLoss``). docs/design/moe.md.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.common.experts import Experts
from hpctrain.model.moe_shape import expert_hidden, shared_experts_config
from hpctrain.model.shape import GPTConfig

RESIDUAL_OUTPUTS = ("experts.w_out", "shared.c_proj.weight")
"""A MoE layer's parameters that write into the residual stream (GPT-2's scaled init)."""


def local_dispatch(routed: torch.Tensor, counts: torch.Tensor, experts: Callable) -> torch.Tensor:
    """Every expert on this rank: ``routed`` (M, C) token copies sorted by expert,
    ``counts`` (E,) copies per expert -> each copy's expert output (M, C)."""
    return experts(routed, counts.tolist())


class AddAuxiliaryLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward, gives ``loss`` the gradient ``scale``, as if
    ``loss * scale`` had been added to the scaled training loss (Megatron-LM's
    auxiliary-loss scaler). So a pipeline stage's router losses need no path to the
    last stage, and they are scaled like the main loss (1/dp, 1/micro-batches)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(loss)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


class MoEStats:
    """What a MoE layer counted since the last ``reset``: copies per expert, copies
    dropped by the capacity factor, and the sums of its auxiliary losses, over the
    micro-batches of a step (forwards in backward, a recomputation, are not counted)."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts
        self.reset()

    def reset(self) -> None:
        """Start counting afresh. The sums stay on the layer's device until read, so
        counting costs no wait."""
        self.load: torch.Tensor | int = 0
        self.dropped: torch.Tensor | int = 0
        self.aux_sum: torch.Tensor | float = 0.0
        self.z_sum: torch.Tensor | float = 0.0
        self.passes = 0

    def values(self) -> dict:
        """The sums as numbers: ``load`` (a list per expert), ``dropped``, ``aux``, ``z``
        (sums over ``passes`` micro-batches)."""
        load = (self.load.tolist() if isinstance(self.load, torch.Tensor)
                else [0] * self.n_experts)
        return {"load": [int(v) for v in load], "dropped": int(self.dropped),
                "aux": float(self.aux_sum), "z": float(self.z_sum), "passes": self.passes}


class MoE(nn.Module):
    """(B, T, C) -> (B, T, C): the routed experts' weighted sum, plus the shared experts'."""

    def __init__(self, cfg: GPTConfig, layers, index: int = 0):
        """``layers``: the family's ``FamilyLayers`` (its MLP builds the shared experts,
        its ``expert_activation`` the routed ones); ``index``: the block's, in the whole
        model (the metrics name the layer by it)."""
        super().__init__()
        self.index = index
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router_kind, self.norm_topk = cfg.moe_router, cfg.moe_norm_topk
        self.aux_coef, self.z_coef, self.capacity = cfg.moe_aux_loss, cfg.moe_z_loss, cfg.moe_capacity
        self.router = nn.Linear(cfg.n_embd, cfg.moe_experts, bias=False)
        gated = cfg.family.mlp_matrices == 3
        self.experts = Experts(cfg.moe_experts, cfg.n_embd, expert_hidden(cfg), gated,
                               layers.expert_activation)
        if cfg.moe_shared:
            self.shared = layers.mlp(shared_experts_config(cfg))
            if cfg.moe_shared_gate:
                self.shared_gate = nn.Linear(cfg.n_embd, 1, bias=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.dispatch: Callable = local_dispatch
        """How token copies reach their experts: ``local_dispatch``, or the expert-parallel
        all-to-all (``parallel/experts/``), which holds this rank's experts only."""
        self.loss_scale = 1.0
        """What the training loss is multiplied by before backward (``set_loss_scale``):
        the auxiliary losses get the same factor."""
        self.stats = MoEStats(cfg.moe_experts)
        self.tensor_parallel = None
        """Under tensor parallelism (``parallel/tensor/moe.py``): ``enter(x)`` gives the
        layer every token of the group (each rank routes them all alike and computes its
        slice of every expert's hidden units), ``leave(y)`` sums the ranks' partial
        outputs, and ``aux_share`` (1/tp) scales the auxiliary losses' gradient, which
        every rank adds alike. None: the layer is whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tensor_parallel
        if tp is not None:
            x = tp.enter(x)
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C), N = B T
        logits = self.router(flat).float()  # (N, E), the routing in fp32
        weights, chosen, scores = self.route(logits)  # (N, k), (N, k), (N, E)
        copies = chosen.reshape(-1)  # (N k,): copy j of token n is n k + j
        order = torch.argsort(copies, stable=True)  # grouped by expert, tokens in order
        counts = torch.bincount(copies, minlength=self.n_experts)
        kept_order, kept_counts, dropped = self.apply_capacity(order, counts, flat.size(0))
        token_of = kept_order // self.top_k
        routed = flat.index_select(0, token_of)  # (M, C); index_select: faster than [ ]
        out = self.dispatch(routed, kept_counts, self.experts)  # (M, C)
        w = weights.reshape(-1)[kept_order].to(out.dtype)
        y = torch.zeros_like(flat).index_add_(0, token_of, out * w[:, None])
        if hasattr(self, "shared"):
            shared = self.shared(flat)
            if hasattr(self, "shared_gate"):
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            y = y + shared
        y = self.drop(y.view(B, T, C))
        counting = self.training and torch._C._current_graph_task_id() == -1
        if torch.is_grad_enabled() and self.training:
            y = self.add_losses(y, logits, scores, chosen, B, counting)
        if counting:
            self.stats.load = self.stats.load + counts.detach()
            self.stats.dropped = self.stats.dropped + dropped
        return y if tp is None else tp.leave(y)

    def route(self, logits: torch.Tensor):
        """Top-k weights, the experts chosen, and every expert's score per token."""
        scores = (torch.softmax(logits, dim=-1) if self.router_kind == "softmax"
                  else torch.sigmoid(logits))
        top, chosen = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        return top, chosen, scores

    def apply_capacity(self, order: torch.Tensor, counts: torch.Tensor, n_tokens: int):
        """With a capacity factor, each expert keeps its first ceil(factor N k / E) copies
        (in token order) and drops the rest: the copies kept, the counts after dropping,
        and how many were dropped. Dropless (factor 0): everything, unchanged."""
        if not self.capacity:
            return order, counts, 0
        cap = math.ceil(self.capacity * n_tokens * self.top_k / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel(), device=order.device) - torch.repeat_interleave(
            starts, counts)
        keep = rank_in_expert < cap
        kept = counts.clamp(max=cap)
        return order[keep], kept, (counts - kept).sum()

    def add_losses(self, y, logits, scores, chosen, B: int, counting: bool):
        """The load-balancing loss per sequence (Switch Transformer's E sum_i f_i P_i, with
        f_i the share of the sequence's copies routed to expert i, P_i its mean score,
        scores summing to one per token), averaged over the micro-batch's sequences, and
        the router z-loss (ST-MoE: mean log-sum-exp squared), attached to ``y``."""
        E, k = self.n_experts, self.top_k
        probs = scores if self.router_kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        per_seq = probs.view(B, -1, E)  # (B, T, E)
        T = per_seq.size(1)
        sequence = torch.arange(B, device=chosen.device).repeat_interleave(T * k)
        hits = torch.bincount(sequence * E + chosen.reshape(-1), minlength=B * E)
        share = hits.view(B, E).float() * (E / (T * k))  # copies per expert; 1 when even
        aux = (share * per_seq.mean(1)).sum(-1).mean()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        if counting:
            self.stats.aux_sum = self.stats.aux_sum + aux.detach()
            self.stats.z_sum = self.stats.z_sum + z.detach()
            self.stats.passes += 1
        total = self.aux_coef * aux + self.z_coef * z
        if not (self.aux_coef or self.z_coef):
            return y
        share = 1.0 if self.tensor_parallel is None else self.tensor_parallel.aux_share
        return AddAuxiliaryLoss.apply(y, total, self.loss_scale * share)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model`` (a GPT or a pipeline stage), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_loss_scale(model: nn.Module, scale: float) -> None:
    """Tell every MoE layer of ``model`` what the training loss is multiplied by before
    backward (a runner calls it once per step)."""
    for layer in moe_layers(model):
        layer.loss_scale = scale
