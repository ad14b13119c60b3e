"""Which torch Distributed Checkpoint (DCP) tensors make each hpctrain parameter.

A Llama-family model takes torchtitan's names (its ``llama3`` model): the fused
``c_attn`` is cut into ``wq``, ``wk``, ``wv`` and ``c_fc`` into ``w1`` (the gate) and
``w3`` (the up projection). The rows come from ``hf_names.rules``, so the cuts are the
ones the Hugging Face export makes; only the names differ, and the rotary pairing: ours
(and Hugging Face's) pairs channel i with i + hs/2 in a head, torchtitan's llama3 pairs
2i with 2i + 1, so the rows of ``wq`` and ``wk`` (and of their Adam moments) are
permuted head by head (``to_interleaved``). Every other family (GPT-2 has no torchtitan
model) keeps hpctrain's own names and tensors as they are. A Llama with experts or
with ``qkv_bias`` is refused: torchtitan's llama3 has neither, and its MoE models name
and route their experts their own way. Both directions walk the one list ``rules``.
``docs/design/dcp-interop.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hpctrain.checkpoint.format import CheckpointError
from hpctrain.checkpoint.hf_names import rules as hf_rules
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple[str, ...]
    """The DCP tensors it is made of, its rows in this order."""
    rows: tuple[int, ...]
    heads: tuple[int, ...]
    """Per piece: the heads whose rows are permuted to torchtitan's rotary pairing (0:
    none)."""
    vocab: bool = False
    """Rows are the vocabulary: ours padded to ``padded_vocab_size``, theirs not."""


TORCHTITAN = ((r"model\.embed_tokens\.", "tok_embeddings."),
              (r"model\.layers\.(\d+)\.self_attn\.q_proj\.", r"layers.\1.attention.wq."),
              (r"model\.layers\.(\d+)\.self_attn\.k_proj\.", r"layers.\1.attention.wk."),
              (r"model\.layers\.(\d+)\.self_attn\.v_proj\.", r"layers.\1.attention.wv."),
              (r"model\.layers\.(\d+)\.self_attn\.o_proj\.", r"layers.\1.attention.wo."),
              (r"model\.layers\.(\d+)\.mlp\.gate_proj\.", r"layers.\1.feed_forward.w1."),
              (r"model\.layers\.(\d+)\.mlp\.down_proj\.", r"layers.\1.feed_forward.w2."),
              (r"model\.layers\.(\d+)\.mlp\.up_proj\.", r"layers.\1.feed_forward.w3."),
              (r"model\.layers\.(\d+)\.input_layernorm\.", r"layers.\1.attention_norm."),
              (r"model\.layers\.(\d+)\.post_attention_layernorm\.", r"layers.\1.ffn_norm."),
              (r"model\.norm\.", "norm."),
              (r"lm_head\.", "output."))
"""Hugging Face Llama name -> torchtitan llama3 name (``hf_names._llama``'s names)."""


def _titan(name: str) -> str:
    for pattern, repl in TORCHTITAN:
        new, n = re.subn(f"^{pattern}", repl, name)
        if n:
            return new
    raise KeyError(f"no torchtitan name for {name}")  # a bug: TORCHTITAN misses a rule


def rules(model: dict) -> list[Rule]:
    """Every parameter of the model ``model`` records, in ``GPT.named_parameters`` order."""
    cfg = GPTConfig.from_shape(model)
    if cfg.family.hugging_face == "llama":
        if cfg.moe_experts or (cfg.qkv_bias and not cfg.bias):
            what = "experts (moe_experts > 0)" if cfg.moe_experts else "qkv_bias=true"
            raise CheckpointError(f"a Llama with {what} has no torchtitan llama3 form: "
                                  "export it with --format hf or --format safetensors")
        out = []
        for r in hf_rules(model):
            names = tuple(_titan(t) for t in r.theirs)
            heads = tuple(cfg.n_head if ".attention.wq." in n else
                          cfg.n_kv_head if ".attention.wk." in n else 0 for n in names)
            out.append(Rule(r.ours, names, r.rows, heads, vocab=r.vocab))
        return out
    with torch.device("meta"):  # names and shapes only
        shapes = [(n, tuple(p.shape)) for n, p in GPT(cfg).named_parameters()]
    vocab = ("wte.weight", "lm_head.weight")
    return [Rule(n, (n,), (cfg.vocab_size if n in vocab else s[0],), (0,), vocab=n in vocab)
            for n, s in shapes]


def dcp_names(model: dict) -> list[str]:
    """Every model tensor name of the DCP checkpoint, in order."""
    return [t for r in rules(model) for t in r.theirs]


def to_interleaved(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of one projection from the half-split rotary pairing to the interleaved one:
    in each head, rows (i, i + hs/2) become rows (2i, 2i + 1)."""
    return t.reshape(heads, 2, -1, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_half_split(t: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``to_interleaved``."""
    return t.reshape(heads, -1, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_dcp(tensors: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """hpctrain tensors (parameters, or an Adam moment of each) -> DCP names, contiguous,
    the vocabulary unpadded."""
    out = {}
    for r in rules(model):
        t = tensors[r.ours].detach()
        if r.vocab:
            t = t[:sum(r.rows)]
        for name, piece, heads in zip(r.theirs, t.split(list(r.rows), dim=0), r.heads):
            out[name] = (to_interleaved(piece, heads) if heads else piece).contiguous()
    return out


def from_dcp(tensors: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """DCP tensors -> hpctrain parameters (fp32, vocabulary padded with zero rows). A
    tensor whose shape is not the one ``model`` implies is a ValueError naming it."""
    cfg = GPTConfig.from_shape(model)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}
    out = {}
    for r in rules(model):
        want = shapes[r.ours]
        pieces = []
        for name, rows, heads in zip(r.theirs, r.rows, r.heads):
            t = tensors[name].float()
            if r.vocab and rows < t.shape[0] <= want[0]:  # saved padded, as a GPT holds it
                if t[rows:].any():
                    raise ValueError(f"{name} has {t.shape[0]} rows and the vocabulary "
                                     f"{rows}, but its rows past the vocabulary are not zero")
                t = t[:rows]
            if tuple(t.shape) != (rows, *want[1:]):
                raise ValueError(f"{name} has shape {list(t.shape)}, but the model implies "
                                 f"{[rows, *want[1:]]}")
            pieces.append(to_half_split(t, heads) if heads else t)
        t = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if r.vocab and t.shape[0] < want[0]:
            t = torch.cat([t, t.new_zeros(want[0] - t.shape[0], *t.shape[1:])])
        out[r.ours] = t.contiguous()
    return out
