"""GPT-2's parts: LayerNorm, the GELU MLP and the learned position embedding."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.common.layers import FamilyLayers
from hpctrain.model.shape import GPTConfig


class GeluMLP(nn.Module):
    """c_proj(gelu(c_fc(x))): (B, T, C) -> (B, T, H) -> (B, T, C)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class GPT2Layers(FamilyLayers):
    @staticmethod
    def norm(cfg: GPTConfig) -> nn.Module:
        return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)

    @staticmethod
    def mlp(cfg: GPTConfig) -> nn.Module:
        return GeluMLP(cfg)

    @staticmethod
    def expert_activation(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h)

    @staticmethod
    def positions(cfg: GPTConfig) -> nn.Module:
        return nn.Embedding(cfg.block_size, cfg.n_embd)
