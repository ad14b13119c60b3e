"""Checks a configuration cannot make on itself: those that need the number of ranks, or
the file system where the run writes."""

from __future__ import annotations

import os
from pathlib import Path

from hpctrain.config.sections import Config
from hpctrain.errors import ConfigError, factor_hint


def check_layout(cfg: Config, world_size: int) -> None:
    """Checks that need the number of ranks."""
    pp, tp, cp = cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.cp
    if world_size % tp:
        raise ConfigError(f"{world_size} rank(s) cannot form tensor-parallel groups of "
                          f"--parallel.tp={tp}: {factor_hint(world_size, tp, '--parallel.tp')}")
    if (world_size // tp) % cp:
        raise ConfigError(f"{world_size} rank(s) cannot form context-parallel groups of "
                          f"--parallel.cp={cp} (x tp={tp}): "
                          f"{factor_hint(world_size // tp, cp, '--parallel.cp', group=tp)}")
    groups = world_size // (tp * cp)
    if groups % pp:
        ranks = (f"{world_size} rank(s)" if tp * cp == 1 else
                 f"{world_size} rank(s) in {groups} group(s) of {tp * cp} (tp x cp)")
        raise ConfigError(f"{ranks} cannot form pipelines of --parallel.pp={pp} stages: "
                          f"{factor_hint(groups, pp, group=tp * cp)}")
    dp = world_size // (pp * tp * cp)
    check_experts(cfg, dp)
    per_step = dp * cfg.parallel.micro_batches
    if cfg.train.batch_size % per_step:
        lower = max(per_step, cfg.train.batch_size // per_step * per_step)
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} cannot be split evenly over {dp} "
            f"data-parallel replica(s) x {cfg.parallel.micro_batches} micro-batch(es); use a "
            f"multiple of {per_step} (e.g. --train.batch_size={lower} or "
            f"{lower + per_step}), or change the number of ranks")


def check_experts(cfg: Config, dp: int | None = None) -> None:
    """What a mixture of experts combines with, and expert parallelism's divisibility
    (``dp``: the data-parallel replicas, when known). The balancing loss is per whole
    sequence (context parallelism would cut it), so cp does not combine with MoE blocks;
    tensor parallelism splits each expert's hidden units (``parallel/tensor/moe.py``),
    but not yet together with expert parallelism."""
    p, experts = cfg.parallel, cfg.model.moe_experts
    if p.ep > 1 and p.tp > 1:
        raise ConfigError(f"--parallel.ep={p.ep} with --parallel.tp={p.tp}: expert and "
                          "tensor parallelism do not combine yet; use --parallel.tp=1 to "
                          "share the experts out, or --parallel.ep=1 to split each expert "
                          "over the tensor-parallel ranks")
    if experts and p.cp > 1:
        raise ConfigError(f"--parallel.cp={p.cp} cannot combine with MoE blocks "
                          f"(model.moe_experts={experts}): the balancing loss needs each "
                          "whole sequence on one rank; use --parallel.cp=1")
    if p.ep == 1:
        return
    if cfg.comm.transport == "shm":
        raise ConfigError(f"--parallel.ep={p.ep} reduces the experts' gradients over "
                          "another group than the rest, with MPI: use --comm.transport="
                          "auto or mpi")
    if not experts:
        raise ConfigError(f"--parallel.ep={p.ep} shares out the experts of MoE blocks, and "
                          "this model has none; set --model.moe_experts or --parallel.ep=1")
    if experts % p.ep:
        raise ConfigError(f"model.moe_experts={experts} cannot be shared out evenly over "
                          f"--parallel.ep={p.ep} ranks; use one of "
                          f"{', '.join(str(d) for d in _divisors(experts))}")
    if dp is not None and dp % p.ep:
        raise ConfigError(f"--parallel.ep={p.ep} groups are drawn from the {dp} "
                          f"data-parallel replica(s); use a divisor of both "
                          f"({', '.join(str(d) for d in _divisors(dp) if experts % d == 0)})"
                          f" or run on more ranks")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_out_dir(out_dir: str, option: str = "--train.out_dir") -> None:
    """Fail at once when ``out_dir`` cannot become a directory this process writes in.

    Checked where the command starts, before MPI: otherwise every rank loads the data and
    builds the model, and rank 0 fails at its first write (or a later checkpoint), which
    the other ranks see only as an abort. Nothing is created here.
    """
    path = Path(out_dir)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{option}={out_dir} is a file, not a directory; name a directory "
                          "(it is created if missing)")
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent  # the nearest part of the path that exists
    if not os.path.isdir(existing):
        raise ConfigError(f"{option}={out_dir}: {existing} is a file, so no directory can "
                          "be made under it; choose another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}={out_dir}: cannot create or write files in {existing} "
                          "(no permission, or a read-only file system); choose a directory "
                          "you can write to")
