"""``parallelize(gpt, grid, cfg)``: wrap a whole GPT for this rank's place in the grid.

One fixed order (as torchtitan's ``parallelize``), because each step needs the previous:

1. **Pipeline cut** (pp > 1): keep this rank's stage of the model (its chunks of layers,
   plus the embedding on the first stage and the head on the last). Every rank built the
   whole model from the same seed, so the stages fit together.
2. **Device**: what this rank keeps goes to its device.
3. **Gradient engine** over the data-parallel ranks of this stage: plain data parallelism
   (``DataParallel``) for fp32 without sharding, ``Zero`` for ZeRO stages 1-3 and for bf16
   (stage 0 with bf16 is replicated data parallelism with fp32 master weights). The engine
   may turn the parameters into bf16 views of its buffers, so it comes before anything
   that reads their dtype. With a pipeline, the gradient norm also sums over the stages.
4. **Runner**: the pipeline executor, or ``LocalRunner`` when the model is whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.model.gpt import GPT
from hpctrain.parallel.data_parallel import DataParallel
from hpctrain.parallel.engine import GradEngine
from hpctrain.parallel.pipeline.executor import PipelineExecutor
from hpctrain.parallel.pipeline.stage import PipelineStage
from hpctrain.parallel.runner import LocalRunner
from hpctrain.parallel.zero import Zero


@dataclass
class Parallel:
    model: torch.nn.Module
    """What this rank holds: the whole GPT, or its pipeline stage."""
    engine: GradEngine
    runner: LocalRunner | PipelineExecutor


def parallelize(gpt: GPT, grid: ProcessGrid, cfg) -> Parallel:
    """``cfg``: the run's ``Config`` (its parallel, optim and train sections). Collective
    over the grid's world (the engine starts every replica from rank 0's parameters)."""
    par, world = cfg.parallel, grid.world
    device = torch.device(world.device)
    pipelined = par.pp > 1
    if pipelined:
        model = PipelineStage(gpt, grid.stage, par.pp, par.virtual_stages, device=device)
    else:
        model = gpt.to(device)
    norm_comms = (grid.pp_comm,) if pipelined else ()
    if par.zero > 0 or cfg.train.dtype != "fp32":
        engine = Zero(model, grid.dp_world, cfg.optim, stage=par.zero, dtype=cfg.train.dtype,
                      bucket_mb=par.bucket_mb, first_bucket_mb=par.first_bucket_mb,
                      blocks=None if pipelined else list(model.h), norm_comms=norm_comms)
    else:
        engine = DataParallel(model, grid.dp_world, cfg.optim, bucket_mb=par.bucket_mb,
                              first_bucket_mb=par.first_bucket_mb, allreduce=par.allreduce,
                              norm_comms=norm_comms)
    if pipelined:
        model.sync_head_dtype()  # the engine may have turned the parameters into bf16
        runner = PipelineExecutor(model, grid, kind=par.schedule, n_micro=par.micro_batches,
                                  seq=cfg.model.block_size, timeout=world.timeout)
    else:
        runner = LocalRunner(model, world.accel)
    return Parallel(model, engine, runner)
