"""Llama's parts: RMSNorm, the SwiGLU MLP and the rotary embedding (``rope.py``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.common.layers import FamilyLayers
from hpctrain.model.llama.rope import Rotary
from hpctrain.model.shape import GPTConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), in fp32 whatever the input's dtype,
    as Llama's reference code does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """c_proj(silu(gate) * up) (Shazeer 2020); ``c_fc`` holds the gate and the up
    projection in one matrix (2H rows: gate first)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.ffn_hidden
        self.c_fc = nn.Linear(cfg.n_embd, 2 * h, bias=cfg.bias)
        self.c_proj = nn.Linear(h, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)
        return self.drop(self.c_proj(F.silu(gate) * up))


class LlamaLayers(FamilyLayers):
    @staticmethod
    def norm(cfg: GPTConfig) -> nn.Module:
        return RMSNorm(cfg.n_embd, cfg.norm_eps)

    @staticmethod
    def mlp(cfg: GPTConfig) -> nn.Module:
        return SwiGLU(cfg)

    @staticmethod
    def expert_activation(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(cfg: GPTConfig) -> Rotary:
        return Rotary(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
