"""A model family's parallel plan: what ``parallel/`` may split, cut and tie, by name.

``parallel/`` is model-agnostic: it names no parameter of any model and asks the plan
instead (as torchtitan keeps each model's ``parallelize`` beside the model). Pure data
and pure functions, no torch: the config, the planner and the checkpoint tools read it
on login nodes. What a family provides: docs/design/models.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from hpctrain.model.moe_shape import expert_hidden, shared_experts_config

COLUMN, ROW = "column", "row"
"""Megatron-LM's two splits (Shoeybi et al. 2019, section 3): a column-parallel layer
keeps a slice of its output features (its weight's rows); a row-parallel layer keeps a
slice of its input features (its weight's columns) and sums its output over the group."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: along ``dim``, each of its ``parts`` (sizes along
    ``dim`` that add up to the whole) cut into tp equal slices."""

    dim: int
    parts: tuple[int, ...]

    def local_parts(self, tp: int) -> tuple[int, ...]:
        return tuple(p // tp for p in self.parts)


@dataclass(frozen=True)
class TensorSplit:
    """One linear layer of every block that tensor parallelism splits."""

    path: str
    """The layer's module path inside a block (``block.get_submodule(path)``)."""
    style: str
    """``COLUMN`` or ``ROW``."""
    parts: Callable
    """``parts(cfg) -> tuple[int, ...]``: COLUMN, the sizes of the fused parts along the
    output features (each part is cut into tp slices, so rank r holds the r-th slice of
    every part); ROW, the one input width that is cut."""


@dataclass(frozen=True)
class ParallelPlan:
    """Where each part of a family's model is, by attribute name, for the parallel code."""

    block_splits: tuple[TensorSplit, ...]
    """The layers tensor parallelism splits inside each block, in a column -> row pair
    per sublayer (the row layer writes into the residual stream)."""
    attention: str
    """The block's attention module; tensor parallelism calls its ``keep_heads(tp)``
    after the split, so it computes n_head / tp heads."""
    block_norms: tuple[str, ...]
    """Modules of a block that hold whole parameters inside the sequence-parallel
    region: under sequence parallelism their gradients are summed over the group."""
    blocks: str = "h"
    """The model's ``nn.ModuleList`` of blocks: the units a pipeline cuts between."""
    embedding: tuple[str, ...] = ("wte", "drop")
    """What the first pipeline stage holds besides blocks (the token embedding first)."""
    token_embedding: str = "wte"
    """The token embedding: vocabulary-parallel under tensor parallelism; a tied head
    uses its matrix."""
    final_norm: str = "ln_f"
    """The norm before the head (on the last stage, in the sequence-parallel region)."""
    head: str = "lm_head"
    """The output head: its own parameter when untied, else it shares the embedding's."""
    moe: str = "mlp"
    """A MoE block's mixture-of-experts layer (``common/moe.py``): its ``dispatch`` is
    what expert parallelism replaces."""
    experts: str = "mlp.experts"
    """A MoE block's routed experts: parameters stacked along dimension 0, one row per
    expert, which expert parallelism cuts into each rank's experts."""

    def head_modules(self, tied: bool) -> tuple[str, ...]:
        """What the last pipeline stage holds besides blocks."""
        return (self.final_norm,) if tied else (self.final_norm, self.head)

    def residual_outputs(self) -> tuple[str, ...]:
        """The layers that write into the residual stream (GPT-2's scaled init)."""
        return tuple(s.path for s in self.block_splits if s.style == ROW)

    def shard_spec(self, name: str, cfg) -> ShardSpec | None:
        """How parameter ``name`` (as ``named_parameters`` names it) is split under tensor
        parallelism; None for a parameter every rank of the group holds whole."""
        if name in (f"{self.token_embedding}.weight", f"{self.head}.weight"):
            return ShardSpec(0, (cfg.padded_vocab_size,))
        moe = self._moe_spec(name, cfg)
        if moe is not None:
            return moe
        m = re.fullmatch(rf"{re.escape(self.blocks)}\.\d+\.(.+)\.(weight|bias)", name)
        split = m and next((s for s in self.block_splits if s.path == m.group(1)), None)
        if not split:
            return None
        if split.style == COLUMN:
            return ShardSpec(0, tuple(split.parts(cfg)))
        if m.group(2) == "bias":  # a row layer's bias is added after the reduction
            return None
        return ShardSpec(1, tuple(split.parts(cfg)))


    def _moe_spec(self, name: str, cfg) -> ShardSpec | None:
        """A MoE block's split parameters: each routed expert's hidden units (its input
        projection per part, gate then up, by rows; its output projection by columns),
        and the shared experts' MLP as the dense MLP is split. The router and the shared
        experts' gate stay whole."""
        blocks = re.escape(self.blocks)
        m = re.fullmatch(rf"{blocks}\.\d+\.{re.escape(self.experts)}\.(w_in|w_out)", name)
        if m:
            hidden = expert_hidden(cfg)
            gated = cfg.family.mlp_matrices - 1  # 1 part (in) or 2 (gate, up)
            return ShardSpec(1, (hidden,) * gated) if m.group(1) == "w_in" else ShardSpec(2, (hidden,))
        m = re.fullmatch(rf"{blocks}\.(\d+)\.{re.escape(self.moe)}\.shared\.(.+)\.(weight|bias)",
                         name)
        if not m or not cfg.moe_shared:
            return None
        dense = f"{self.blocks}.{m.group(1)}.{self.moe}.{m.group(2)}.{m.group(3)}"
        return self.shard_spec(dense, shared_experts_config(cfg))


def attention_parts(cfg) -> tuple[int, int, int]:
    """A fused query/key/value projection's rows: nh query heads, then nkv key and nkv
    value heads. Cut per part, rank r keeps the queries, keys and values of the same
    heads (query head j reads key/value head j // (nh / nkv))."""
    hs = cfg.head_size
    return (cfg.n_head * hs, cfg.n_kv_head * hs, cfg.n_kv_head * hs)


def heads_width(cfg) -> tuple[int]:
    """The attention's output projection reads nh heads of hs channels."""
    return (cfg.n_head * cfg.head_size,)


def hidden_width(cfg) -> tuple[int]:
    """The MLP's hidden width, one part."""
    return (cfg.ffn_hidden,)
