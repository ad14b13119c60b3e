"""A MoE layer's routed experts: one MLP per expert, their weights stacked so that the
experts a rank holds are one slice along the first dimension (what expert parallelism
cuts: ``parallel/experts/``).

``w_in`` (E, H or 2H, C) holds each expert's input projection (a gated family's gate
rows, then its up rows, as the dense ``c_fc``), ``w_out`` (E, C, H) its output
projection. The tokens of all experts are multiplied in one grouped matrix multiply
(``torch.nn.functional.grouped_mm``) where torch offers it for the inputs' layout, else
expert by expert (``grouped=False`` forces the loop; ``perf/bench_moe.py`` measures
both).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ALIGN_BYTES = 16
"""grouped_mm wants every row stride a multiple of 16 bytes."""


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's backward
    refuses an expanded one (a sum's)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class Experts(nn.Module):
    def __init__(self, n_experts: int, n_embd: int, hidden: int, gated: bool,
                 activation: Callable[[torch.Tensor], torch.Tensor]):
        """``activation``: the family's (``FamilyLayers.expert_activation``): (M, H or
        2H) -> (M, H)."""
        super().__init__()
        self.n_experts, self.first = n_experts, 0
        self.w_in = nn.Parameter(torch.empty(n_experts, (2 if gated else 1) * hidden, n_embd))
        self.w_out = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.activation = activation
        self.grouped = hasattr(F, "grouped_mm")

    def keep(self, first: int, count: int) -> None:
        """Hold global experts ``first`` .. ``first + count - 1`` only (expert
        parallelism: this rank's slice)."""
        self.w_in = nn.Parameter(self.w_in.detach()[first:first + count].clone())
        self.w_out = nn.Parameter(self.w_out.detach()[first:first + count].clone())
        self.first, self.n_experts = first, count

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` (M, C), grouped by this module's experts, ``counts[j]`` rows for
        its j-th -> (M, C), each row through its expert."""
        if self.grouped and self._groupable(tokens):
            offsets = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
            h = F.grouped_mm(tokens, self.w_in.transpose(1, 2), offs=offsets)
            out = F.grouped_mm(self.activation(h), self.w_out.transpose(1, 2), offs=offsets)
            return _ContiguousGrad.apply(out)
        pieces = tokens.split(counts)
        outs = [F.linear(self.activation(F.linear(p, self.w_in[j])), self.w_out[j])
                for j, p in enumerate(pieces)]
        return torch.cat(outs) if outs else tokens[:0]

    def _groupable(self, tokens: torch.Tensor) -> bool:
        size = tokens.element_size()
        return (tokens.dtype == self.w_in.dtype and tokens.is_contiguous()
                and all(n * size % ALIGN_BYTES == 0 for n in
                        (self.w_in.size(1), self.w_in.size(2), self.w_out.size(2))))
