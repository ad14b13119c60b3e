"""Cross-entropy over a vocabulary split across the tensor-parallel group, without ever
gathering the logits (Megatron-LM's vocabulary-parallel cross-entropy).

Each rank computes its own slice of the logits; one all-gather of two numbers per token
(the slice's log-sum-exp and the target's logit) gives every rank the loss
``logsumexp(all logits) - logit[t]``, and backward needs no communication here. It works
a chunk of tokens at a time, as ``chunked_loss.py`` does, and the padded vocabulary rows
get no logit. The derivation: ``docs/design/tensor-parallel.md`` ("The loss").
"""

from __future__ import annotations

import torch

from hpctrain.parallel.tensor.group import TensorParallelGroup


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, group: TensorParallelGroup, start: int, real: int,
                chunk: int):
        """h (N, C): the final-normed hidden states, the same on every rank; weight
        (rows, C): this rank's rows of the head, of which the first ``real`` are real
        tokens; targets (N,), -1 for tokens that do not count. Returns the mean loss."""
        n = h.size(0)
        chunk = chunk or n
        w = weight[:real]
        mine = torch.zeros(2, n, dtype=torch.float32, device=h.device)  # lse, target logit
        for s in range(0, n, chunk):
            logits = (h[s:s + chunk] @ w.t()).float()
            mine[0, s:s + chunk] = torch.logsumexp(logits, dim=-1)  # -inf with no columns
            local, inside = _local_targets(targets[s:s + chunk], start, real)
            if real:
                picked = logits.gather(1, local[:, None])[:, 0]
                mine[1, s:s + chunk] = torch.where(inside, picked, 0.0)
        every = group.all_gather(mine[None], dim=0)  # (tp, 2, N)
        lse = torch.logsumexp(every[:, 0], dim=0)
        target_logit = every[:, 1].sum(0)
        counted = targets != -1
        count = counted.sum()
        ctx.save_for_backward(h, weight, targets, lse, count)
        ctx.start, ctx.real, ctx.chunk = start, real, chunk
        return ((lse - target_logit) * counted).sum() / count

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, targets, lse, count = ctx.saved_tensors
        start, real, chunk = ctx.start, ctx.real, ctx.chunk
        w = weight[:real]
        scale = grad_loss / count
        grad_h = torch.zeros_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, h.size(0) if real else 0, chunk):
            hc, t = h[s:s + chunk], targets[s:s + chunk]
            # softmax - one_hot(t) on this rank's columns, zero for ignored tokens
            g = (hc @ w.t()).float().sub_(lse[s:s + chunk, None]).exp_()
            local, inside = _local_targets(t, start, real)
            rows = torch.arange(t.size(0), device=t.device)
            g[rows[inside], local[inside]] -= 1.0
            g *= (scale * (t != -1))[:, None]
            g = g.to(h.dtype)
            grad_h[s:s + chunk] = g @ w
            grad_w[:real] += (g.t() @ hc).float()
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def _local_targets(t: torch.Tensor, start: int, real: int):
    """Targets as column indices of this rank's logits (0 where outside), and whether
    each lies in this rank's range of real tokens."""
    local = t - start
    inside = (local >= 0) & (local < real)
    return local.masked_fill(~inside, 0), inside


def vocab_parallel_cross_entropy(h: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, group: TensorParallelGroup,
                                 start: int, real: int, chunk: int = 0) -> torch.Tensor:
    """Mean cross-entropy of ``h`` (B, T, C) against ``targets`` with the head's rows
    ``weight`` of tokens ``[start, start + real)`` on this rank."""
    return VocabParallelCrossEntropy.apply(h.reshape(-1, h.size(-1)), weight,
                                           targets.reshape(-1), group, start, real, chunk)
