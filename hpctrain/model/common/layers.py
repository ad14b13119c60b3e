"""The attention and the pre-norm block every family shares, and ``FamilyLayers``: the
parts a family supplies (norm, MLP, rotary, learned positions).

Shapes: B batch, T time (tokens), C channels (n_embd), nh heads, nkv key/value heads,
hs head size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpctrain.model.common.moe import MoE
from hpctrain.model.common.recompute import selective_checkpoint
from hpctrain.model.moe_shape import is_moe_block
from hpctrain.model.shape import GPTConfig


class FamilyLayers:
    """What a family builds its parts with (``Family.layers()`` returns a subclass)."""

    @staticmethod
    def norm(cfg: GPTConfig) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def mlp(cfg: GPTConfig) -> nn.Module:
        """(B, T, C) -> (B, T, C); its linear layers are named in the family's plan."""
        raise NotImplementedError

    @staticmethod
    def expert_activation(h: torch.Tensor) -> torch.Tensor:
        """A routed expert's activation, on its input projection's output (M, H) (or
        (M, 2H) for a gated MLP: gate, then up) -> (M, H) (``experts.py``)."""
        raise NotImplementedError

    @staticmethod
    def rotary(cfg: GPTConfig):
        """The attention's rotary embedding (``llama/rope.py``), None without one."""
        return None

    @staticmethod
    def positions(cfg: GPTConfig) -> nn.Module | None:
        """A learned position embedding (``wpe``), None without one."""
        return None

    @classmethod
    def block(cls, cfg: GPTConfig, index: int = 0) -> nn.Module:
        """Block ``index`` of the model (it decides how the block recomputes, and
        whether its MLP is a mixture of experts)."""
        return Block(cfg, cls, cfg.block_recompute(index),
                     moe_index=index if is_moe_block(cfg, index) else None)


class CausalSelfAttention(nn.Module):
    """One projection ``c_attn`` makes the queries (nh heads), keys and values (nkv heads
    each); with nkv < nh each key/value head serves nh / nkv query heads. ``c_attn`` has
    a bias with ``bias`` or ``qkv_bias`` (Qwen2's attention), ``c_proj`` with ``bias``."""

    def __init__(self, cfg: GPTConfig, rotary=None):
        super().__init__()
        self.n_head, self.n_kv_head, hs = cfg.n_head, cfg.n_kv_head, cfg.head_size
        self.head_size = hs
        self.widths = [cfg.n_head * hs, cfg.n_kv_head * hs, cfg.n_kv_head * hs]
        self.c_attn = nn.Linear(cfg.n_embd, sum(self.widths), bias=cfg.bias or cfg.qkv_bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.rotary = rotary
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.context = None
        """Under context parallelism (``parallel/context/apply.py``): the attention of
        this rank's part of each sequence over the whole, ``context(q, k, v)``."""

    def keep_heads(self, tp: int) -> None:
        """After tensor parallelism split ``c_attn`` per part: compute this rank's
        nh / tp query and nkv / tp key/value heads."""
        self.n_head, self.n_kv_head = self.n_head // tp, self.n_kv_head // tp
        self.widths = [w // tp for w in self.widths]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # whole sequences even where x holds a rank's tokens
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.widths, dim=2)
        # (B, T, heads * hs) -> (B, heads, T, hs)
        q, k, v = (t.view(B, T, -1, self.head_size).transpose(1, 2) for t in (q, k, v))
        if self.rotary is not None:
            q, k = self.rotary.rotate(q), self.rotary.rotate(k)
        if self.context is not None:
            y = self.context(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True,
                enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, nh, T, hs) -> (B, T, nh hs)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    """x + attn(ln_1(x)), then + mlp(ln_2(x)).

    ``recompute`` (``GPTConfig.block_recompute``): 'block' keeps only the block's input
    and runs the body again in backward (Chen et al. 2016); 'selective' keeps the matmul
    and attention outputs and recomputes the element-wise work (``recompute.py``).
    ``compile_model`` sets ``compiled_body`` (and ``compiled_selective``). All act
    inside ``forward``, so module hooks on the block (ZeRO-3's gathers) run once per
    forward (docs/design/compute-options.md)."""

    def __init__(self, cfg: GPTConfig, layers: type[FamilyLayers] | None = None,
                 recompute: str | None = None, moe_index: int | None = None):
        """``layers``: the family's parts; by default those of ``cfg``'s family.
        ``recompute``: this block's mode; by default ``cfg.recompute``. ``moe_index``:
        the block's index when it is a MoE block (``moe.py``, in place of the MLP)."""
        super().__init__()
        layers = layers or cfg.family.layers()
        self.ln_1 = layers.norm(cfg)
        self.attn = CausalSelfAttention(cfg, layers.rotary(cfg))
        self.ln_2 = layers.norm(cfg)
        self.mlp = layers.mlp(cfg) if moe_index is None else MoE(cfg, layers, moe_index)
        self.recompute = recompute or cfg.recompute
        self.compiled_body = None  # torch.compile(self.body), set by compile_model
        self.compiled_selective = None  # torch.compile(self.selective), likewise

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def selective(self, x: torch.Tensor) -> torch.Tensor:
        """``body`` under selective recomputation. Compiled, the compiler traces the
        policy and its partitioner keeps what it marks."""
        return selective_checkpoint(self.body, x, keep_attention=self.attn.dropout == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.body if self.compiled_body is None else self.compiled_body
        if not torch.is_grad_enabled() or self.recompute == "none":
            return body(x)
        if self.recompute == "block":
            # Saves only x; the first saved tensor backward asks for runs body(x) again,
            # with the same dropout masks (the RNG state is restored).
            return checkpoint(body, x, use_reentrant=False)
        if self.compiled_selective is not None:
            return self.compiled_selective(x)
        return self.selective(x)
