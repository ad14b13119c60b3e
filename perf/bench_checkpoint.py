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
checkpoints, with synchronous ones, and with asynchronous ones (``--train.ckpt_async``: a
thread writes the shard while training goes on), interleaved rounds, median [min, max].

Third part: the training stall per checkpoint, one rank, a model large enough that a
synchronous save takes seconds (STALL_MODEL: ~77M parameters, ~0.9 GB of state).
Stall = the main thread's time in the saver per checkpoint (a synchronous save whole; an
asynchronous one's memory check, copy and temporary folder, the per-step "written?"
checks and the publication), against the synchronous save's, for the 2nd and 3rd
checkpoints of a run and apart for the 1st (whose copy also allocates the buffers:
page faults); the wall time of the whole run; and the step time of the
steps trained while a write was in flight against the steps that were not (the cost of
writing in the background: the writer competes for the cores and the memory bandwidth).
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
            load_sharded(path, zero, grid, model_shape=cfg.shape())
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
        f"--train.ckpt_async={mode == 'async'}"])
    result = Trainer(cfg, World.create(comm), verbose=False).fit()
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        out.write_text(json.dumps({"wall_s": result.wall_s}))


STALL_MODEL = dict(n_layer=6, n_head=8, n_embd=1024, block_size=32)
STALL_STEPS, STALL_EVERY = 23, 6
"""Saves at 6, 12 and 18; the last one's write has five steps to finish before the end."""


def worker_stall(out: Path, mode: str, data: str) -> None:
    """One run of STALL_STEPS steps with a checkpoint every STALL_EVERY (``mode``: sync or
    async): the saver's main-thread time per checkpoint and each step's time, marked by
    whether a write was in flight."""
    import time

    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.train.saving import CheckpointSaver
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    tmp = scratch_dir("ckpt-stall", comm)
    cfg = load_config("shakespeare-char", [
        f"--data.path={data}", *(f"--model.{k}={v}" for k, v in STALL_MODEL.items()),
        f"--train.batch_size={comm.size}", f"--train.max_iters={STALL_STEPS}",
        "--data.verify=false", "--train.eval_interval=0", "--train.final_eval=false",
        "--train.sample_tokens=0", "--train.save_checkpoint=false", "--train.progress=false",
        f"--train.log_interval={STALL_EVERY}", f"--train.out_dir={tmp}", "--train.ckpt_keep=1",
        f"--train.ckpt_interval={STALL_EVERY}", f"--train.ckpt_async={mode == 'async'}"])
    stalls, depth = {"save": [], "poll": [], "finish_pending": []}, [0]

    def timed(method):  # the saver's entry points; inner calls are not counted twice
        def run(self, *args, **kwargs):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    stalls[method.__name__].append(time.perf_counter() - t0)
        return run

    for name in ("save", "poll", "finish_pending"):
        setattr(CheckpointSaver, name, timed(getattr(CheckpointSaver, name)))
    trainer = Trainer(cfg, World.create(comm), verbose=False)
    in_flight, step = [], Trainer.train_step

    def marked(self, s):
        in_flight.append(self.saver._pending is not None)
        return step(self, s)

    Trainer.train_step = marked
    saves = []
    trainer.saver.on_saved = saves.append
    result = trainer.fit()
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        # Per checkpoint: its save() call, and its share of the checks and waits. The
        # first asynchronous save also allocates the buffers (page faults): apart.
        share = (sum(stalls["poll"]) + sum(stalls["finish_pending"])) / len(saves)
        per_ckpt = [t + share for t in stalls["save"]]
        out.write_text(json.dumps({
            "checkpoints": len(saves), "stall_first_s": per_ckpt[0],
            "stall_s": statistics.median(per_ckpt[1:]), "stall_parts_s": stalls,
            "save_s": saves, "wall_s": result.wall_s,
            "overlapped_steps": trainer.saver.overlapped,
            "step_s": result.step_times, "in_flight": in_flight}))


def stall_part(data: Path, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for _ in range(rounds):
        for mode in runs:
            runs[mode].append(run_worker(1, __file__, ["stall", mode, str(data)]))
    stall = {m: [r["stall_s"] for r in rs] for m, rs in runs.items()}
    first = {m: [r["stall_first_s"] for r in rs] for m, rs in runs.items()}
    wall = {m: [r["wall_s"] for r in rs] for m, rs in runs.items()}
    sync_save = [s for r in runs["sync"] for s in r["save_s"]]
    # The first step of a run (warm-up) is in neither group.
    steps = {flag: [t for r in runs["async"] for t, f in
                    list(zip(r["step_s"], r["in_flight"]))[1:] if f == flag]
             for flag in (True, False)}
    med = {k: statistics.median(v) for k, v in stall.items()}
    sync_med = statistics.median(sync_save)
    ratio = med["async"] / sync_med
    overlap_cost = statistics.median(steps[True]) / statistics.median(steps[False]) - 1
    print_table(f"Training stall per checkpoint, {STALL_MODEL} (1 rank, "
                f"{STALL_STEPS} steps, a checkpoint every {STALL_EVERY}); median [min, max] "
                f"of {rounds} run(s)",
                ["checkpoints", "stall s (2nd, 3rd)", "stall / sync save",
                 "1st stall s", "1st / sync save", "run wall s"],
                [[m, fmt_spread(stall[m]), med[m] / sync_med, fmt_spread(first[m]),
                  statistics.median(first[m]) / sync_med, fmt_spread(wall[m])]
                 for m in runs])
    print_table("Step time of the asynchronous runs: steps trained while a write was in "
                "flight vs the others", ["steps", "n", "step s", "cost"],
                [["write in flight", len(steps[True]), fmt_spread(steps[True]), overlap_cost],
                 ["no write", len(steps[False]), fmt_spread(steps[False]), 0.0]])
    return {"model": STALL_MODEL, "runs": runs, "stall_s": stall, "median_stall_s": med,
            "first_stall_s": first, "wall_s": wall,
            "first_stall_ratio": statistics.median(first["async"]) / sync_med,
            "sync_save_s": sync_save, "stall_ratio": ratio, "goal_ratio": 0.2,
            "step_s_in_flight": steps[True], "step_s_no_write": steps[False],
            "overlap_cost": overlap_cost}


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
    walls: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
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
                           "overhead_async": med["async"] / med["none"] - 1}
    records["stall"] = stall_part(data, rounds)
    write_result("checkpoint", {"quick": args.quick, "repeats": repeats, "model": MODEL,
                                "records": records}, smoke=args.quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if rest[0] == "train":
            worker_train(out, rest[1], rest[2])
        elif rest[0] == "stall":
            worker_stall(out, rest[1], rest[2])
        else:
            worker(out, rest[0], int(rest[1]))
    else:
        main(rest)
