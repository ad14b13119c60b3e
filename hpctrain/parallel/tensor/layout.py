"""Which parameters tensor parallelism splits, along which dimension, and how.

One pure description serves everything that moves between a whole model and its
tensor-parallel shards: ``tensor_parallelize`` slices a built GPT with it, the outputs
and checkpoints put whole tensors back together with it, and the checks on a model's
shape read it. It knows only the names and the shape (``GPTConfig``).

Megatron-LM's split (Shoeybi et al. 2019, "Megatron-LM", section 3):

| parameter | split | why |
|---|---|---|
| ``wte.weight``, untied ``lm_head.weight`` | rows (vocabulary) | each rank looks up and scores its own slice of the (padded) vocabulary |
| ``attn.c_attn`` weight and bias | rows, per part (q, k, v) | each rank computes its own heads |
| ``mlp.c_fc`` weight and bias | rows, per part (gate, up) | each rank computes its slice of the hidden width |
| ``attn.c_proj.weight``, ``mlp.c_proj.weight`` | columns | the row-parallel output projections read the heads / hidden width this rank has |
| norms, ``wpe``, the output projections' biases | not split | the same on every rank of the group |

A fused matrix is split *per part*: ``c_attn`` holds the queries of every head, then the
keys, then the values; rank r of tp keeps the r-th slice of each part, so that its rows
are the queries, keys and values of the same heads (and, with grouped-query attention,
the key/value heads its query heads use: query head j reads key/value head j // (nh /
nkv), and both counts are cut into tp equal runs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hpctrain.errors import UserError
from hpctrain.model.shape import GPTConfig


class TensorParallelError(UserError):
    """A model shape or layout that tensor parallelism cannot split."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: along ``dim``, each of its ``parts`` (sizes along
    ``dim`` that add up to the whole) cut into tp equal slices."""

    dim: int
    parts: tuple[int, ...]

    def local_parts(self, tp: int) -> tuple[int, ...]:
        return tuple(p // tp for p in self.parts)


_BLOCK = re.compile(r"h\.\d+\.(attn|mlp)\.(c_attn|c_fc|c_proj)\.(weight|bias)")


def shard_spec(name: str, cfg: GPTConfig) -> ShardSpec | None:
    """How parameter ``name`` (as ``GPT.named_parameters`` names it) is split; None for
    a parameter every rank of the group holds whole."""
    if name in ("wte.weight", "lm_head.weight"):
        return ShardSpec(0, (cfg.padded_vocab_size,))
    m = _BLOCK.fullmatch(name)
    if m is None:
        return None
    _, layer, kind = m.groups()
    hs = cfg.head_size
    if layer == "c_attn":
        return ShardSpec(0, (cfg.n_head * hs, cfg.n_kv_head * hs, cfg.n_kv_head * hs))
    if layer == "c_fc":
        h = cfg.ffn_hidden
        return ShardSpec(0, (h, h) if cfg.arch == "llama" else (h,))
    if kind == "bias":  # the output projections' bias is added after the reduction
        return None
    width = cfg.n_head * hs if m.group(1) == "attn" else cfg.ffn_hidden
    return ShardSpec(1, (width,))


def check_splittable(cfg: GPTConfig, tp: int) -> None:
    """A clear error, naming the option to change, when ``tp`` cannot split ``cfg``."""
    if tp == 1:
        return
    fixes = []
    if cfg.n_kv_head < tp:
        fixes.append(f"n_kv_head={cfg.n_kv_head} key/value heads cannot be shared out over "
                     f"{tp} ranks (each needs at least one); use --parallel.tp <= "
                     f"{cfg.n_kv_head} or more --model.n_kv_head")
    elif cfg.n_kv_head % tp:
        fixes.append(f"--model.n_kv_head={cfg.n_kv_head} is not a multiple of "
                     f"--parallel.tp={tp}")
    if cfg.n_head % tp:
        fixes.append(f"--model.n_head={cfg.n_head} is not a multiple of --parallel.tp={tp}")
    if cfg.ffn_hidden % tp:
        fixes.append(f"the MLP's hidden width {cfg.ffn_hidden} (--model.ffn_hidden) is not "
                     f"a multiple of --parallel.tp={tp}")
    if cfg.padded_vocab_size % tp:
        fixes.append(f"the vocabulary of {cfg.padded_vocab_size} rows is not a multiple of "
                     f"--parallel.tp={tp}: pad it with --model.vocab_multiple (e.g. "
                     f"{64 * tp})")
    if fixes:
        raise TensorParallelError(f"--parallel.tp={tp} cannot split this model: "
                                  + "; ".join(fixes))


def shard(full, spec: ShardSpec, rank: int, tp: int):
    """Rank ``rank``'s slice of the whole tensor ``full`` (a new contiguous tensor)."""
    import torch

    pieces = [part.chunk(tp, spec.dim)[rank] for part in full.split(spec.parts, spec.dim)]
    return torch.cat(pieces, spec.dim).contiguous()


def unshard(shards: list, spec: ShardSpec):
    """The whole tensor from every rank's slice (``shards`` in rank order)."""
    import torch

    tp = len(shards)
    per_rank = [s.split(spec.local_parts(tp), spec.dim) for s in shards]
    parts = [torch.cat([pieces[j] for pieces in per_rank], spec.dim)
             for j in range(len(spec.parts))]
    return torch.cat(parts, spec.dim)


QUALIFIER = "@tp"
"""A sharded checkpoint names rank r's slice of ``name`` ``name@tp<r>``."""


def qualified_name(name: str, rank: int) -> str:
    return f"{name}{QUALIFIER}{rank}"


def join_slices(state: dict[str, dict], cfg: GPTConfig, tp: int) -> dict[str, dict]:
    """Whole tensors from a checkpoint's entries: ``name@tp<r>`` slices (every key of
    each, e.g. ``param`` and the moments) are joined into ``name``; whole entries pass
    through. A missing slice is a KeyError naming it."""
    if tp == 1:
        return state
    out = {n: v for n, v in state.items() if QUALIFIER not in n}
    bases = sorted({n.split(QUALIFIER)[0] for n in state if QUALIFIER in n})
    for base in bases:
        spec = shard_spec(base, cfg)
        if spec is None:
            raise KeyError(f"{base} is recorded in slices but is not split")
        slices = [state[qualified_name(base, r)] for r in range(tp)]
        out[base] = {k: unshard([s[k] for s in slices], spec) for k in slices[0]}
    return out
