"""Checkpoint save and load bandwidth: hpctrain's sharded checkpoints at 1, 2 and 4 ranks
vs ``torch.save`` / ``torch.load`` of the same state from one process, in the same run.

State: a GPT of about 30M parameters after one AdamW step: fp32 parameters and both
Adam moments (12 bytes per parameter, ~360 MB), ZeRO-1 so that each rank holds and
writes 1/N of it. Save time includes the fsync of every file and the atomic rename (the
torch file is fsynced too, so both are on disk when the clock stops); load time includes
reading, CRC checks and resharding into the engine (warm page cache: the file was just
written). Bandwidth = state bytes / median time. Median of REPEATS [min, max].

      python perf/bench_checkpoint.py --shakespeare PATH [--quick]

Second part: the cost of checkpointing during training. ``shakespeare-char`` data, the
10.7M-parameter GPT (6 layers, width 384, block 256, 4 rows per rank), 2 ranks, ZeRO-1,
20 steps with a checkpoint every 5: wall time of the training loop with no periodic
checkpoints, with synchronous ones, and with background ones (a thread writes the shard
while training goes on), interleaved rounds, median [min, max].
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (bench_parser, fmt_spread, print_table, run_worker,  # noqa: E402
                         scratch_dir, shakespeare_dataset, worker_args, write_result)
from hpctrain.sizes import MiB  # noqa: E402

MODEL = dict(vocab_size=65, block_size=128, n_layer=8, n_head=8, n_embd=576)
REPEATS = 5


def worker(out: Path, mode: str, repeats: int) -> None:
    import time

    import torch
    from mpi4py import MPI

    from hpctrain.checkpoint.distributed import load_sharded, save_sharded
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.comm.world import World
    from hpctrain.config import OptimConfig
    from hpctrain.model.gpt import GPT, GPTConfig
    from hpctrain.parallel.zero import Zero

    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = 12 * n_params
    tmp = scratch_dir("ckpt", comm)
    times: dict[str, list[float]] = {"save": [], "load": []}
    if mode == "torch":  # one process, the whole state
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
        model(x, x).backward()
        opt.step()
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        for _ in range(repeats):
            path = Path(tmp) / "state.pt"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            times["save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loaded = torch.load(path, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optim"])
            times["load"].append(time.perf_counter() - t0)
    else:
        world = World.create(comm)
        grid = ProcessGrid.create(world)
        zero = Zero(model, world, OptimConfig(), level=1)
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
        zero.prepare_for_backward(last_micro=True)
        model(x, x).backward()
        zero.finish()
        zero.step(1e-3, 1.0)
        for rep in range(repeats):
            comm.Barrier()
            t0 = MPI.Wtime()
            path = save_sharded(Path(tmp) / "checkpoints", rep + 1, zero, grid,
                                run={"config": _config(), "model": cfg.shape()},
                                keep=1)
            comm.Barrier()
            times["save"].append(MPI.Wtime() - t0)
            t0 = MPI.Wtime()
            load_sharded(path, zero, grid, model_shape=model_shape(cfg))
            comm.Barrier()
            times["load"].append(MPI.Wtime() - t0)
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        med = {k: statistics.median(v) for k, v in times.items()}
        out.write_text(json.dumps({"params": n_params, "bytes": state_bytes,
                                   "save_s": med["save"], "load_s": med["load"],
                                   "all_s": times}))


TRAIN_STEPS, TRAIN_EVERY, TRAIN_ROUNDS = 20, 5, 3


def worker_train(out: Path, mode: str, data: str) -> None:

    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    tmp = scratch_dir("ckpt-train", comm)
    cfg = load_config("shakespeare-char", [
        f"--data.path={data}", "--model.n_layer=6", "--model.n_head=6",
        "--model.n_embd=384", "--model.block_size=256", f"--train.batch_size={4 * comm.size}",
        f"--train.max_iters={TRAIN_STEPS}", "--parallel.zero=1", "--data.verify=false",
        "--train.eval_interval=0", "--train.final_eval=false", "--train.sample_tokens=0",
        "--train.save_checkpoint=false", "--train.progress=false",
        f"--train.log_interval={TRAIN_EVERY}", f"--train.out_dir={tmp}",
        f"--train.ckpt_interval={0 if mode == 'none' else TRAIN_EVERY}",
        f"--train.ckpt_background={mode == 'background'}"])
    result = Trainer(cfg, World.create(comm), verbose=False).fit()
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        out.write_text(json.dumps({"wall_s": result.wall_s}))


def _config() -> dict:
    from hpctrain.config import build_config

    return build_config({}).to_dict()


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__, shakespeare=True).parse_args(argv)
    data = shakespeare_dataset(args.shakespeare)
    repeats, rounds = (2, 1) if args.quick else (REPEATS, TRAIN_ROUNDS)
    torch_r = run_worker(1, __file__, ["torch", str(repeats)])
    rows, records = [], {"torch": torch_r, "hpctrain": {}}
    gb = torch_r["bytes"] / 1e9

    def row(method, n, r):
        return [method, n, fmt_spread(r["all_s"]["save"]), gb / r["save_s"],
                fmt_spread(r["all_s"]["load"]), gb / r["load_s"],
                torch_r["save_s"] / r["save_s"], torch_r["load_s"] / r["load_s"]]

    rows.append(row("torch.save/load", 1, torch_r))
    for n in (1, 2, 4):
        r = run_worker(n, __file__, ["sharded", str(repeats)])
        records["hpctrain"][n] = r
        rows.append(row("hpctrain sharded", n, r))
    print_table(f"Checkpoint of {torch_r['params'] / 1e6:.1f}M parameters "
                f"({torch_r['bytes'] / MiB:.0f} MiB: fp32 params + Adam moments); "
                f"seconds: median [min, max] of {repeats}; GB/s and ratios from the medians",
                ["method", "ranks", "save s", "save GB/s", "load s", "load GB/s",
                 "save vs torch", "load vs torch"], rows)
    walls: dict[str, list[float]] = {"none": [], "sync": [], "background": []}
    for _ in range(rounds):
        for mode in walls:
            walls[mode].append(run_worker(2, __file__, ["train", mode, str(data)])["wall_s"])
    med = {k: statistics.median(v) for k, v in walls.items()}
    print_table(f"Training wall time, {TRAIN_STEPS} steps, a checkpoint every {TRAIN_EVERY} "
                f"(10.7M parameters, 2 ranks, ZeRO-1); median [min, max] of {rounds}; "
                "overhead from the medians",
                ["checkpoints", "wall s", "overhead"],
                [[k, fmt_spread(walls[k]), v / med["none"] - 1] for k, v in med.items()])
    records["training"] = {"wall_s": walls, "median_s": med,
                           "overhead_sync": med["sync"] / med["none"] - 1,
                           "overhead_background": med["background"] / med["none"] - 1}
    write_result("checkpoint", {"quick": args.quick, "repeats": repeats, "model": MODEL,
                                "records": records}, smoke=args.quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if rest[0] == "train":
            worker_train(out, rest[1], rest[2])
        else:
            worker(out, rest[0], int(rest[1]))
    else:
        main(rest)
