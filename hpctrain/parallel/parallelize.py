"""``parallelize(gpt, grid, cfg)``: wrap a whole GPT for this rank's place in the grid.

One fixed order (as torchtitan's ``parallelize``), because each step needs the previous:
0. tensor split (tp > 1, ``tensor/apply.py``), then FP8 linear layers (``--train.fp8``,
``fp8.py``: the swapped modules keep their parameters, which every later step takes as
they are; a split layer gets an FP8 product for its local multiply); 1. pipeline cut
(pp > 1: this rank's stage); 2. device, then ring attention and global positions on what the rank holds
(cp > 1, ``context/apply.py``), and this rank's experts of every MoE layer with the
all-to-all dispatch (ep > 1, ``experts/apply.py``); 3. gradient engine over the stage's
data-parallel and context-parallel ranks, the experts' over the ranks holding them
(``Zero``, ``DataParallel`` or ``MixedPrecisionDataParallel``; it may turn parameters
into bf16 views, so it comes before anything that reads their dtype); 4. runner
(pipeline executor or ``LocalRunner``); 5. compute settings (TF32, then
``torch.compile`` of each block and of the head, last, so the engine's hooks stay
outside the compiled code).
Each step and why: docs/design/training-step.md ("``parallelize(gpt, grid, cfg)``").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.model.gpt import GPT, compile_model
from hpctrain.parallel.choose_engine import build_engine
from hpctrain.parallel.context.apply import context_parallelize
from hpctrain.parallel.context.chunks import loader_parts
from hpctrain.parallel.context.ring import Ring
from hpctrain.parallel.engine import GradEngine
from hpctrain.parallel.experts.apply import expert_parallelize
from hpctrain.parallel.fp8 import Fp8Layers, fp8_parallelize
from hpctrain.parallel.pipeline.executor import PipelineExecutor
from hpctrain.parallel.pipeline.schedules import SPLIT_BACKWARD, V_PLACED
from hpctrain.parallel.pipeline.stage import PipelineStage
from hpctrain.parallel.pipeline.pass_times import PassTimes
from hpctrain.parallel.runner import LocalRunner, Runner
from hpctrain.parallel.tensor.apply import tensor_parallelize
from hpctrain.parallel.tensor.group import TensorParallelGroup


@dataclass
class Parallel:
    model: torch.nn.Module
    """What this rank holds: the whole GPT, or its pipeline stage."""
    engine: GradEngine
    runner: Runner
    fp8: Fp8Layers | None = None
    """The layers ``--train.fp8`` put in FP8 (None: off)."""


def parallelize(gpt: GPT, grid: ProcessGrid, cfg) -> Parallel:
    """``cfg``: the run's ``Config`` (its parallel, optim and train sections). Collective
    over the grid's world (the engine starts every replica from rank 0's parameters)."""
    par, world = cfg.parallel, grid.world
    device = torch.device(world.device)
    pipelined = par.pp > 1
    if grid.tp > 1:
        tensor_parallelize(gpt, TensorParallelGroup(grid.tp_comm, world),
                           sequence_parallel=par.sequence_parallel)
    fp8 = fp8_parallelize(gpt, grid, cfg) if cfg.train.fp8 else None
    if pipelined:
        model = PipelineStage(gpt, grid.stage, par.pp, par.virtual_stages, device=device,
                              v_shape=par.schedule in V_PLACED)
    else:
        model = gpt.to(device)
    if grid.cp > 1:  # on the stage: its embedding is the one that runs
        context_parallelize(model, Ring.of_world(grid.cp_comm, world))
    if grid.ep > 1:  # every rank built the same whole model: the slices fit together
        expert_parallelize(model, grid.ep_comm, world, grid.resources)
    engine = build_engine(model, grid.dp_world, cfg,
                          blocks=None if pipelined else whole_blocks(model),
                          norm_comms=(grid.pp_comm,) if pipelined else (), tp_comm=grid.tp_comm,
                          experts=grid.expert_world if grid.ep > 1 else None,
                          ep_comm=grid.ep_comm)
    if pipelined:
        model.sync_head_dtype()  # the engine may have turned the parameters into bf16
        runner = PipelineExecutor(model, grid, kind=par.schedule, n_micro=par.micro_batches,
                                  seq=cfg.model.block_size // grid.cp,
                                  timeout=world.timeout,
                                  order_times=PassTimes(*(par.pass_time_ratios() or ())))
    else:
        runner = LocalRunner(model, world.accel, whole=grid.tp == grid.cp == grid.ep == 1)
    set_matmul_precision(device, cfg.train.tf32)
    if cfg.train.compile:
        compile_model(model, backward_twice=pipelined and par.schedule in SPLIT_BACKWARD)
    return Parallel(model, engine, runner, fp8)


def sequence_parts(grid: ProcessGrid) -> tuple[tuple[int, ...], int]:
    """(which parts of each sequence this rank reads, into how many it is cut): for the
    data loader, whose reads follow the context-parallel layout (``context/chunks.py``)."""
    return loader_parts(grid.cp_index, grid.cp)


def whole_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of a whole model, in order (ZeRO-3 gathers each before it runs)."""
    return list(model.get_submodule(model.plan.blocks))


def set_matmul_precision(device: torch.device, tf32: bool) -> bool:
    """Let fp32 matrix multiplies and convolutions use TF32 on a GPU (10-bit mantissa
    inputs, fp32 accumulation: the precision nanoGPT trains with; 8x the fp32 rate on an
    A100). Process-wide, so set only where a rank trains on an accelerator, never on a
    CPU rank, whose results must stay those of the plain fp32 model. This call sets
    CUDA's and oneDNN's precision together (oneDNN runs XPU matmuls; not yet checked on
    an XPU); setting one backend through torch's newer per-backend flags would make
    ``torch.get_float32_matmul_precision()``, which the compiler reads, raise (torch
    2.13). Returns whether it changed anything."""
    if device.type not in ("cuda", "xpu"):
        return False
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.allow_tf32 = tf32
    return True
