"""Which parameters tensor parallelism splits, along which dimension, and how.

One pure description serves everything that moves between a whole model and its
tensor-parallel shards: ``tensor_parallelize`` slices a built model with it, the outputs
and checkpoints put whole tensors back together with it, and the checks on a model's
shape read it. The family's parallel plan (``model/plan.py``) names the parameters;
this module only cuts and joins (Megatron-LM's split, Shoeybi et al. 2019, section 3).
"""

from __future__ import annotations

from hpctrain.errors import UserError
from hpctrain.model.plan import ShardSpec
from hpctrain.model.shape import GPTConfig

class TensorParallelError(UserError):
    """A model shape or layout that tensor parallelism cannot split."""


def shard_spec(name: str, cfg: GPTConfig) -> ShardSpec | None:
    """How parameter ``name`` (as ``named_parameters`` names it) is split, by the plan of
    ``cfg``'s family; None for a parameter every rank of the group holds whole."""
    return cfg.family.plan.shard_spec(name, cfg)


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


EXPERT_QUALIFIER = "@ep"
"""... and rank r's slice of a layer's experts (expert parallelism) ``name@ep<r>``."""


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


def join_expert_slices(state: dict[str, dict], ep: int) -> dict[str, dict]:
    """Whole stacked experts from a checkpoint's ``name@ep<r>`` entries (rank r's
    experts, consecutive along dimension 0); other entries pass through. A missing slice
    is a KeyError naming it."""
    if ep == 1:
        return state
    import torch

    out = {n: v for n, v in state.items() if EXPERT_QUALIFIER not in n}
    for base in sorted({n.split(EXPERT_QUALIFIER)[0] for n in state if EXPERT_QUALIFIER in n}):
        slices = [state[f"{base}{EXPERT_QUALIFIER}{r}"] for r in range(ep)]
        out[base] = {k: torch.cat([s[k] for s in slices], 0) for k in slices[0]}
    return out
