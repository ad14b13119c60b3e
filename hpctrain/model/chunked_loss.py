"""The head and the cross-entropy, a chunk of tokens at a time (``--model.loss_chunk``).

The tokens x vocabulary logits, in fp32, decide at long context whether a batch fits
(4 GiB for 8K tokens of a 128K vocabulary, and as much again in backward). This function
never holds more than one chunk's logits: forward keeps only each token's log-sum-exp,
and backward computes each chunk's logits again, for one more head matmul per chunk. It
computes the same numbers as the plain cross-entropy, up to the order of the sum over
tokens. ``docs/design/long-context.md``.
"""

from __future__ import annotations

import torch


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, vocab: int, chunk: int):
        """h (N, C) final-normed hidden states, weight (Vp, C), targets (N,) with -1 for
        tokens that do not count; returns the mean loss over the counted tokens."""
        w = weight[:vocab]
        lse = torch.empty(h.size(0), dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.size(0), chunk):
            logits = (h[s:s + chunk] @ w.t()).float()
            t = targets[s:s + chunk]
            lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
            total += ((lse[s:s + chunk] - picked) * (t != -1)).sum()
        count = (targets != -1).sum()
        ctx.save_for_backward(h, weight, targets, lse, count)
        ctx.vocab, ctx.chunk = vocab, chunk
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight, targets, lse, count = ctx.saved_tensors
        vocab, chunk = ctx.vocab, ctx.chunk
        w = weight[:vocab]
        scale = grad_loss / count
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for s in range(0, h.size(0), chunk):
            hc, t = h[s:s + chunk], targets[s:s + chunk]
            # d loss / d logits = (softmax - one_hot(t)) / count, zero for ignored tokens;
            # in place, so that a chunk's logits exist once (their fp32 copy in bf16)
            g = (hc @ w.t()).float().sub_(lse[s:s + chunk, None]).exp_()
            g[torch.arange(t.size(0), device=t.device), t.clamp(min=0)] -= 1.0
            g *= (scale * (t != -1))[:, None]
            g = g.to(h.dtype)
            if grad_h is not None:
                grad_h[s:s + chunk] = g @ w
            grad_w[:vocab] += (g.t() @ hc).float()
        return grad_h, grad_w.to(weight.dtype), None, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          vocab: int, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight[:vocab].T`` (h: (B, T, C) or (N, C)) against
    ``targets``, ``chunk`` tokens at a time."""
    return ChunkedCrossEntropy.apply(h.reshape(-1, h.size(-1)), weight, targets.reshape(-1),
                                     vocab, chunk)
