"""Worker of ``perf/gpu_check.py``: a small fp32 training on the node's device, its losses
and final parameters as JSON (rank 0), and optionally the host's waits for the device
per step.

    mpiexec -n 2 python perf/gpu_equivalence.py --worker --out r.json --data small.h5 \\
        --device cuda --collectives xccl

TF32 is off, so 1 and 2 ranks differ only by the order of fp32 sums; ``--tp 2``
(and ``--sequence-parallel``) splits the layers over the 2 ranks instead of the batch;
``--zero N`` shards the optimizer state, gradients and (3) parameters over them. ``--count-syncs``
turns on CUDA's sync debug mode for the steps after the first two and counts the
synchronizing calls it reports (each is the host waiting for the device).
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

from hpctrain.comm.world import World
from hpctrain.config import build_config
from hpctrain.train.trainer import Trainer


def _config(data: str, out: str, steps: int, device: str, tp: int, sequence_parallel: bool,
            compile_: bool, zero: int):
    return build_config({
        "model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 64},
        "data": {"path": data},
        "optim": {"lr": 3e-3, "warmup_iters": 2, "min_lr": 3e-4},
        "parallel": {"micro_batches": 2, "bucket_mb": 0.25, "first_bucket_mb": 0.05,
                     "tp": tp, "sequence_parallel": sequence_parallel, "zero": zero},
        "train": {"batch_size": 16, "max_iters": steps, "log_interval": steps,
                  "eval_interval": 0, "final_eval": False, "out_dir": out,
                  "sample_tokens": 0, "save_checkpoint": False, "progress": False,
                  "tf32": False, "device": device, "compile": compile_}})


class SyncCounter:
    """Counts CUDA's warnings about synchronizing calls while it is on."""

    def __init__(self, accel):
        self.on = accel.kind == "cuda"
        self.count = 0

    def __enter__(self):
        if self.on:
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode(0)
            self.count = sum("synchroniz" in str(w.message) for w in self._seen)
            self._catch.__exit__(*exc)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--collectives", default="mpi")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--count-syncs", action="store_true")
    p.add_argument("--tp", type=int, default=1, help="--parallel.tp")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--compile", action="store_true", help="--train.compile")
    p.add_argument("--zero", type=int, default=0, help="--parallel.zero")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    world = World.create(comm, device=args.device, collectives=args.collectives)
    run_dir = comm.bcast(str(Path(args.out).with_suffix("")) + "-run" if comm.rank == 0
                         else None)
    cfg = _config(args.data, run_dir, args.steps, args.device, args.tp, args.sequence_parallel,
                  args.compile, args.zero)
    trainer = Trainer(cfg, world, verbose=False)
    syncs = None
    if args.count_syncs:  # two warm-up steps, then count over the rest
        original = trainer.train_step
        counted: list[int] = []

        def train_step(step):
            if step < 2:
                return original(step)
            with SyncCounter(world.accel) as counter:
                out = original(step)
            counted.append(counter.count)
            return out

        trainer.train_step = train_step
    result = trainer.fit(close=False)
    if args.count_syncs:
        syncs = counted
    with trainer.engine.gathered():
        state = trainer.engine.consolidated_state()
    params = torch.cat([state[n]["param"].detach().float().reshape(-1).cpu()
                        for n in sorted(state)])
    trainer.close()
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({
            "losses": result.losses, "params": params.tolist(), "world": comm.size,
            "collectives": world.collectives, "transport": world.transport.name,
            "syncs_per_step": syncs, "device": world.accel.describe(),
            "step_ms": [1e3 * s for s in result.step_times]}))


if __name__ == "__main__":
    main()
