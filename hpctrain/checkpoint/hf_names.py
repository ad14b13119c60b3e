"""Which Hugging Face tensors make each hpctrain parameter: one table, read both ways.

``rules(model)`` lists, for a model record (``GPTConfig.shape()``), every hpctrain
parameter with the Hugging Face tensors it is made of; ``to_hf`` (the export) and
``from_hf`` (the import) both walk that one list, so the two directions cannot drift
apart. What differs between the layouts (fused projections, GPT-2's transposed
``Conv1D``, the vocabulary's padding, a tied head, experts stacked in one tensor here and
one tensor per expert and projection there) and the table itself:
``docs/design/hf-interop.md`` ("What is mapped").
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from hpctrain.checkpoint.hf_config import hf_layout
from hpctrain.model.gpt import GPT
from hpctrain.model.moe_shape import expert_hidden, is_moe_block
from hpctrain.model.shape import GPTConfig


@dataclass(frozen=True)
class Rule:
    ours: str
    """The hpctrain parameter."""
    theirs: tuple[str, ...]
    """The Hugging Face tensors it is made of, its rows in this order."""
    rows: tuple[int, ...]
    """Rows (output features) of each of ``theirs``."""
    conv1d: bool = False
    """GPT-2's ``Conv1D``: stored (in, out), the transpose of ours."""
    absent_is_zero: bool = False
    """Hugging Face always has this tensor; a model without it (no biases) writes zeros."""
    vocab: bool = False
    """Rows are the vocabulary: ours are padded to ``padded_vocab_size``, theirs not."""
    stacked: bool = False
    """Ours stacks the experts' matrices (E, rows, cols); theirs are its (E rows, cols)
    rows in order, expert by expert."""


IGNORED = (re.compile(r"transformer\.h\.\d+\.attn\.(masked_)?bias"),  # GPT-2's causal mask
           re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"))  # Llama's
"""Buffers that older transformers saved with the weights: derived, never parameters."""


def rules(model: dict) -> list[Rule]:
    """Every parameter of the model ``model`` records, in ``GPT.named_parameters`` order;
    CheckpointError when no Hugging Face layout computes that model (``hf_layout``)."""
    cfg = GPTConfig.from_shape(model)
    return LAYOUTS[hf_layout(cfg)](cfg)


def _gpt2(cfg: GPTConfig) -> list[Rule]:
    C, H, V = cfg.n_embd, cfg.ffn_hidden, cfg.vocab_size
    out = [Rule("wte.weight", ("transformer.wte.weight",), (V,), vocab=True),
           Rule("wpe.weight", ("transformer.wpe.weight",), (cfg.block_size,))]

    def linear(ours: str, theirs: str, rows: int) -> None:
        out.append(Rule(f"{ours}.weight", (f"{theirs}.weight",), (rows,), conv1d=True))
        out.append(Rule(f"{ours}.bias", (f"{theirs}.bias",), (rows,),
                        absent_is_zero=not cfg.bias))

    def norm(ours: str, theirs: str) -> None:
        out.append(Rule(f"{ours}.weight", (f"{theirs}.weight",), (C,)))
        out.append(Rule(f"{ours}.bias", (f"{theirs}.bias",), (C,), absent_is_zero=not cfg.bias))

    for i in range(cfg.n_layer):
        ours, theirs = f"h.{i}", f"transformer.h.{i}"
        norm(f"{ours}.ln_1", f"{theirs}.ln_1")
        linear(f"{ours}.attn.c_attn", f"{theirs}.attn.c_attn", 3 * C)
        linear(f"{ours}.attn.c_proj", f"{theirs}.attn.c_proj", C)
        norm(f"{ours}.ln_2", f"{theirs}.ln_2")
        linear(f"{ours}.mlp.c_fc", f"{theirs}.mlp.c_fc", H)
        linear(f"{ours}.mlp.c_proj", f"{theirs}.mlp.c_proj", C)
    norm("ln_f", "transformer.ln_f")
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",), (V,), vocab=True))
    return out


def _rotary(cfg: GPTConfig, mlp: Callable[[GPTConfig, int, str, str], list[Rule]],
            zero_qkv_bias: bool = False) -> list[Rule]:
    """Llama's names, which Mixtral and Qwen2-MoE share but for the MLP: ``mlp(cfg, i,
    ours, theirs)`` names block i's. ``zero_qkv_bias``: the layout always has q, k, v
    biases (Qwen2-MoE), zeros for a model without them."""
    C, V = cfg.n_embd, cfg.vocab_size
    q, kv = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
    out = [Rule("wte.weight", ("model.embed_tokens.weight",), (V,), vocab=True)]
    for i in range(cfg.n_layer):
        ours, theirs = f"h.{i}", f"model.layers.{i}"
        attn = f"{theirs}.self_attn"
        out.append(Rule(f"{ours}.ln_1.weight", (f"{theirs}.input_layernorm.weight",), (C,)))
        out += _linear(f"{ours}.attn.c_attn", (f"{attn}.q_proj", f"{attn}.k_proj",
                                               f"{attn}.v_proj"), (q, kv, kv),
                       cfg.bias or cfg.qkv_bias, zero_bias=zero_qkv_bias)
        out += _linear(f"{ours}.attn.c_proj", (f"{attn}.o_proj",), (C,), cfg.bias)
        out.append(Rule(f"{ours}.ln_2.weight", (f"{theirs}.post_attention_layernorm.weight",),
                        (C,)))
        out += mlp(cfg, i, f"{ours}.mlp", theirs)
    out.append(Rule("ln_f.weight", ("model.norm.weight",), (C,)))
    if not cfg.tie_embeddings:
        out.append(Rule("lm_head.weight", ("lm_head.weight",), (V,), vocab=True))
    return out


def _linear(ours: str, theirs: tuple[str, ...], rows: tuple[int, ...], bias: bool,
            zero_bias: bool = False) -> list[Rule]:
    """A linear layer's weight, and its bias when it has one (or zeros, ``zero_bias``)."""
    out = [Rule(f"{ours}.weight", tuple(f"{t}.weight" for t in theirs), rows)]
    if bias or zero_bias:
        out.append(Rule(f"{ours}.bias", tuple(f"{t}.bias" for t in theirs), rows,
                        absent_is_zero=not bias))
    return out


def _swiglu(ours: str, theirs: str, hidden: int, cfg: GPTConfig) -> list[Rule]:
    """Our fused SwiGLU ``c_fc`` (gate rows, then up rows) and ``c_proj``."""
    return (_linear(f"{ours}.c_fc", (f"{theirs}.gate_proj", f"{theirs}.up_proj"),
                    (hidden, hidden), cfg.bias)
            + _linear(f"{ours}.c_proj", (f"{theirs}.down_proj",), (cfg.n_embd,), cfg.bias))


def _experts(ours: str, theirs: str, cfg: GPTConfig, gate: str, up: str, down: str
             ) -> list[Rule]:
    """The router and the stacked experts: ``w_in`` is each expert's gate rows then its
    up rows, ``w_out`` each expert's down projection."""
    E, H = cfg.moe_experts, expert_hidden(cfg)
    w_in = tuple(f"{theirs}.experts.{e}.{n}.weight" for e in range(E) for n in (gate, up))
    w_out = tuple(f"{theirs}.experts.{e}.{down}.weight" for e in range(E))
    return [Rule(f"{ours}.router.weight", (f"{theirs}.gate.weight",), (E,)),
            Rule(f"{ours}.experts.w_in", w_in, (H,) * (2 * E), stacked=True),
            Rule(f"{ours}.experts.w_out", w_out, (cfg.n_embd,) * E, stacked=True)]


def _llama(cfg: GPTConfig) -> list[Rule]:
    return _rotary(cfg, lambda c, i, ours, theirs: _swiglu(ours, f"{theirs}.mlp",
                                                            c.ffn_hidden, c))


def _mixtral(cfg: GPTConfig) -> list[Rule]:
    """Every block a MoE block (``hf_layout`` checked): w1 the gate, w3 the up, w2 the
    down projection of each expert."""
    return _rotary(cfg, lambda c, i, ours, theirs: _experts(
        ours, f"{theirs}.block_sparse_moe", c, "w1", "w3", "w2"))


def _qwen2_moe(cfg: GPTConfig) -> list[Rule]:
    """MoE blocks with one gated shared expert (``moe_shared`` experts wide), the other
    blocks dense."""
    def mlp(c: GPTConfig, i: int, ours: str, theirs: str) -> list[Rule]:
        theirs = f"{theirs}.mlp"
        if not is_moe_block(c, i):
            return _swiglu(ours, theirs, c.ffn_hidden, c)
        return (_experts(ours, theirs, c, "gate_proj", "up_proj", "down_proj")
                + _swiglu(f"{ours}.shared", f"{theirs}.shared_expert",
                          c.moe_shared * expert_hidden(c), c)
                + [Rule(f"{ours}.shared_gate.weight", (f"{theirs}.shared_expert_gate.weight",),
                        (1,))])
    return _rotary(cfg, mlp, zero_qkv_bias=True)


def hf_names(model: dict) -> set[str]:
    """Every tensor name of the Hugging Face model (what an import must find)."""
    return {t for r in rules(model) for t in r.theirs}


def to_hf(params: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """hpctrain parameters -> Hugging Face tensors (fp32, contiguous)."""
    out = {}
    for r in rules(model):
        if r.ours not in params:
            if not r.absent_is_zero:
                raise KeyError(f"the checkpoint has no {r.ours}")
            for name, rows in zip(r.theirs, r.rows):
                out[name] = torch.zeros(rows)
            continue
        t = params[r.ours].detach().float()
        if r.vocab:
            t = t[:sum(r.rows)]
        if r.stacked:
            t = t.reshape(-1, *t.shape[2:])
        for name, piece in zip(r.theirs, t.split(list(r.rows), dim=0)):
            out[name] = (piece.t() if r.conv1d else piece).contiguous()
    return out


def from_hf(tensors: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> hpctrain parameters (fp32, vocabulary padded with zero
    rows). Every tensor must have the shape ``model`` implies: ValueError names the first
    that does not (the caller adds where it was read)."""
    cfg = GPTConfig.from_shape(model)
    with torch.device("meta"):  # the shapes alone, from the model itself: no memory
        shapes = {n: tuple(p.shape) for n, p in GPT(cfg).named_parameters()}
    out = {}
    for r in rules(model):
        want = shapes.get(r.ours)
        if want is None and not r.absent_is_zero:
            raise KeyError(f"{r.ours} is not a parameter of the model")  # a bug in rules()
        pieces = []
        for name, rows in zip(r.theirs, r.rows):
            t = tensors[name].float()
            expect = ((rows,) if want is None else
                      (rows, *want[2:]) if r.stacked else (rows, *want[1:]))
            if r.conv1d:
                expect = expect[::-1]
            if tuple(t.shape) != expect:
                raise ValueError(f"{name} has shape {list(t.shape)}, but config.json implies "
                                 f"{list(expect)}")
            pieces.append(t.t() if r.conv1d else t)
        if want is None:  # absent_is_zero: a bias the model does not have
            if any(p.any() for p in pieces):
                raise ValueError(f"{r.theirs[0]} is not zero, but the model has no biases")
            continue
        t = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if r.stacked:
            t = t.reshape(want)
        if r.vocab and t.shape[0] < want[0]:
            t = torch.cat([t, t.new_zeros(want[0] - t.shape[0], *t.shape[1:])])
        out[r.ours] = t.contiguous()
    return out


LAYOUTS = {"gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral, "qwen2_moe": _qwen2_moe}
"""The Hugging Face layouts, by ``hf_config.hf_layout``."""
