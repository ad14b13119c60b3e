"""The one rule that picks a run's gradient engine, and building that engine.

``parallelize`` builds the engine through ``build_engine``; ``ckpt reshard`` asks
``engine_class`` which engine will resume a checkpoint, to write the state it loads.
"""

from __future__ import annotations

import torch

from hpctrain.comm.world import World
from hpctrain.parallel.data_parallel import DataParallel
from hpctrain.parallel.engine import GradEngine
from hpctrain.parallel.mixed_precision import MixedPrecisionDataParallel
from hpctrain.parallel.zero import Zero


def engine_class(zero: int, dtype: str) -> type:
    """``Zero`` at ZeRO level ``zero`` > 0; without sharding, ``MixedPrecisionDataParallel``
    (fp32 master weights) when computing in ``dtype`` bf16, else ``DataParallel``."""
    if zero > 0:
        return Zero
    if dtype != "fp32":
        return MixedPrecisionDataParallel
    return DataParallel


def build_engine(model: torch.nn.Module, world: World, cfg, *,
                 blocks: list[torch.nn.Module] | None = None, norm_comms: tuple = (),
                 tp_comm=None, experts: World | None = None, ep_comm=None) -> GradEngine:
    """The engine ``engine_class`` picks for ``cfg`` (the run's ``Config``), over ``world``
    (this stage's data-parallel ranks). ``blocks``: what ZeRO-3 gathers (the whole model's
    blocks; None for a pipeline stage); ``norm_comms``, ``tp_comm``, ``experts``,
    ``ep_comm``: see engine.py."""
    par, dtype = cfg.parallel, cfg.train.dtype
    cls = engine_class(par.zero, dtype)
    common = {"bucket_mb": par.bucket_mb, "first_bucket_mb": par.first_bucket_mb,
              "norm_comms": norm_comms, "tp_comm": tp_comm,
              "experts": experts, "ep_comm": ep_comm}
    if cls is Zero:
        return Zero(model, world, cfg.optim, level=par.zero, dtype=dtype, blocks=blocks,
                    **common)
    if cls is MixedPrecisionDataParallel:
        return MixedPrecisionDataParallel(model, world, cfg.optim, dtype=dtype, **common)
    return DataParallel(model, world, cfg.optim, allreduce=cfg.comm.allreduce, **common)
