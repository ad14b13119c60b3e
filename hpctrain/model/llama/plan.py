"""Llama's parallel plan (``model/plan.py``): GPT-2's split, with the SwiGLU input
projection ``mlp.c_fc`` (the gate's rows, then the up projection's) cut per part, so a
rank keeps the gate and the up rows of the same hidden units."""

from __future__ import annotations

from hpctrain.model.gpt2.plan import ATTENTION
from hpctrain.model.plan import COLUMN, ROW, ParallelPlan, TensorSplit, hidden_width

PLAN = ParallelPlan(
    block_splits=(*ATTENTION,
                  TensorSplit("mlp.c_fc", COLUMN, lambda cfg: (cfg.ffn_hidden,) * 2),
                  TensorSplit("mlp.c_proj", ROW, hidden_width)),
    attention="attn", block_norms=("ln_1", "ln_2"), embedding=("wte", "drop"))
