"""GPT-2's parallel plan (``model/plan.py``): Megatron-LM's split of a block.

| parameter | split | why |
|---|---|---|
| ``wte.weight``, untied ``lm_head.weight`` | rows (vocabulary) | each rank looks up and scores its own slice of the (padded) vocabulary |
| ``attn.c_attn`` weight and bias | rows, per part (q, k, v) | each rank computes its own heads |
| ``mlp.c_fc`` weight and bias | rows | each rank computes its slice of the hidden width |
| ``attn.c_proj.weight``, ``mlp.c_proj.weight`` | columns | the output projections read the heads / hidden width this rank has |
| norms, ``wpe``, the output projections' biases | not split | the same on every rank of the group |
"""

from __future__ import annotations

from hpctrain.model.plan import (COLUMN, ROW, ParallelPlan, TensorSplit, attention_parts,
                                 heads_width, hidden_width)

ATTENTION = (TensorSplit("attn.c_attn", COLUMN, attention_parts),
             TensorSplit("attn.c_proj", ROW, heads_width))
"""The attention's split, shared with the families that keep GPT-2's attention."""

PLAN = ParallelPlan(
    block_splits=(*ATTENTION,
                  TensorSplit("mlp.c_fc", COLUMN, hidden_width),
                  TensorSplit("mlp.c_proj", ROW, hidden_width)),
    attention="attn", block_norms=("ln_1", "ln_2"), embedding=("wte", "wpe", "drop"))
