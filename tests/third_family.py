"""A test-only third model family: GPT-2 with a gated-GELU MLP in three separate layers
(``gate_proj``, ``up_proj``, ``down_proj``: names no built-in family has).

It proves the list in docs/design/models.md: a family is its traits, its layers and its
parallel plan, and ``parallel/`` trains it at dp, tp and pp without knowing it. Importing
this module registers it as ``--model.arch=gpt2-geglu`` in the importing process.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.families import register_family
from hpctrain.model.family import LAYER_NORM, LEARNED, Family
from hpctrain.model.gpt2.layers import GPT2Layers
from hpctrain.model.gpt2.plan import ATTENTION
from hpctrain.model.plan import COLUMN, ROW, ParallelPlan, TensorSplit, hidden_width

ARCH = "gpt2-geglu"


class GegluMLP(nn.Module):
    """down_proj(gelu(gate_proj(x)) * up_proj(x)) (Shazeer 2020's GEGLU)."""

    def __init__(self, cfg):
        super().__init__()
        c, h = cfg.n_embd, cfg.ffn_hidden
        self.gate_proj = nn.Linear(c, h, bias=cfg.bias)
        self.up_proj = nn.Linear(c, h, bias=cfg.bias)
        self.down_proj = nn.Linear(h, c, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class GegluLayers(GPT2Layers):
    @staticmethod
    def mlp(cfg) -> nn.Module:
        return GegluMLP(cfg)


PLAN = ParallelPlan(
    block_splits=(*ATTENTION,
                  TensorSplit("mlp.gate_proj", COLUMN, hidden_width),
                  TensorSplit("mlp.up_proj", COLUMN, hidden_width),
                  TensorSplit("mlp.down_proj", ROW, hidden_width)),
    attention="attn", block_norms=("ln_1", "ln_2"), embedding=("wte", "wpe", "drop"))

FAMILY = Family(arch=ARCH, summary="GPT-2 with a gated-GELU MLP (tests only)",
                positions=LEARNED, norm=LAYER_NORM, mlp_matrices=3, grouped_query=False,
                default_ffn_hidden=lambda n_embd: 2 * n_embd, plan=PLAN,
                layers=lambda: GegluLayers)

register_family(FAMILY)
