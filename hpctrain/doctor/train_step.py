"""The doctor's training step: GPT training steps with the trainer's pieces
(``parallelize``, engine, runner) on random tokens, timed, with the MFU where the device's
peak is known. On a GPU it is GPT-2 124M in bf16, compiled (blocks and head), 16 rows of
1024 tokens per rank: the setting MFU floors are meant for (``thresholds.py``)."""

from __future__ import annotations

import math
import time

import torch

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.mpi import MPI
from hpctrain.comm.world import World
from hpctrain.config import load_config
from hpctrain.doctor.comm_checks import agree, planted_fault
from hpctrain.doctor.node_check import NodeCheck
from hpctrain.model.gpt import GPT
from hpctrain.parallel.parallelize import parallelize
from hpctrain.systems.devices import peak_for_device

# GPT-2 124M as trained (vocabulary padded to a multiple of 64), and a CPU-sized one.
SHAPES = {"gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024,
                            vocab_size=50304, batch_per_rank=16),
          "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256,
                        batch_per_rank=8)}


WARMUP_STEPS, TIMED_STEPS = 2, 3


def check_train(world: World, result: NodeCheck, model: str) -> None:
    """Training steps with the trainer's pieces (``parallelize``, engine, runner) on
    random tokens: warm-up steps (compilation), then timed ones (the median counts)."""
    accel = world.accel
    gpu = accel.kind in ("cuda", "xpu")
    name = model if model != "auto" else ("gpt2-124m" if gpu else "small")
    shape = dict(SHAPES[name])
    per_rank = shape.pop("batch_per_rank")
    dtype = "bf16" if gpu else "fp32"
    cfg = load_config("default", [f"--model.{k}={v}" for k, v in shape.items()] + [
        f"--train.batch_size={per_rank * world.size}", f"--train.dtype={dtype}",
        f"--train.device={accel.kind}", f"--train.compile={str(gpu).lower()}"])
    gpt_cfg = cfg.model.to_gpt()
    grid = ProcessGrid.create(world, 1)
    torch.manual_seed(0)
    par = parallelize(GPT(gpt_cfg), grid, cfg)
    gen = torch.Generator().manual_seed(1 + world.rank)
    T = gpt_cfg.block_size
    losses, times = [], []
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        tokens = torch.randint(0, gpt_cfg.vocab_size, (per_rank, T + 1), generator=gen)
        x = accel.to_device(tokens[:, :-1].contiguous())
        y = accel.to_device(tokens[:, 1:].contiguous())
        world.comm.Barrier()
        t0 = time.perf_counter()
        loss = par.runner.train_step([x], [y], par.engine.grad_scale,
                                     par.engine.prepare_for_backward)
        par.engine.finish()
        norm = float(par.engine.step(cfg.optim.lr, cfg.optim.grad_clip))
        par.runner.tie_weights()
        par.engine.zero_grad()
        losses.append(float(loss))  # synchronizes the device: the step is done
        times.append(world.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    par.engine.close()
    seconds = sorted(times[WARMUP_STEPS:])[TIMED_STEPS // 2]
    if planted_fault("train"):
        losses[-1] = float("nan")
    ok = agree(world, all(math.isfinite(v) for v in losses) and math.isfinite(norm),
               "the training step")
    tokens_per_s = per_rank * world.size * T / seconds
    peak = peak_for_device(accel.name, dtype)  # bf16 on a GPU: its matrix units' rate
    mfu = (gpt_cfg.flops_per_token() * tokens_per_s / (peak * 1e12 * world.devices)
           if peak else None)
    result.sections["train"] = {
        "model": name, "params": gpt_cfg.num_params(), "dtype": dtype, "compiled": gpu,
        "batch_per_rank": per_rank, "block_size": T, "losses": losses,
        "step_s": seconds, "tokens_per_s": tokens_per_s, "peak_tflops": peak, "mfu": mfu,
        "memory": accel.describe_memory(), "status": "ok" if ok else "FAILED"}
    if not ok:
        result.fail("train", f"the loss or gradient norm is not finite ({losses})")
