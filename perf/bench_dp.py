"""Data-parallel training throughput at a fixed per-rank batch, on this 2-core machine.

For each model, in one run:
  hpctrain DP=2      2 ranks x 1 thread, per-rank batch b (global 2b)
  hpctrain DP=1      1 rank  x 1 thread, batch b            (weak-scaling anchor)
  2 x DP=1 at once   two independent 1-rank trainers running concurrently, no
                     communication at all: what the two cores give two processes
                     (shared cache, memory and clocks), the ceiling of any scheme
  torch DDP (gloo)   2 ranks x 1 thread, per-rank batch b, same model, data and optimizer
  1 process          2 threads, batch 2b, the nanoGPT-style loop (what a user would
                     otherwise run on this machine)

Weak-scaling efficiency = tok/s(DP=2) / (2 x tok/s(DP=1)). Targets: >= 0.95 and >= 1.0x
torch DDP. The contention ceiling = tok/s(2 x DP=1 at once) / (2 x tok/s(DP=1)), and
communication efficiency = tok/s(DP=2) / tok/s(2 x DP=1 at once) separates what the
hardware takes from what hpctrain's communication takes. Step time is the median over steps after warm-up; each configuration runs
three times, interleaved with the others, and the median of the three counts (this
machine's speed drifts between runs, so only interleaved comparisons mean anything).

    python perf/bench_dp.py [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (ROOT, print_table, run_worker, shakespeare_dataset,  # noqa: E402
                         timed_command, torch_ddp_step_times, worker_args, write_result)

# name -> (n_layer, n_head, n_embd, block_size, per-rank batch, steps)
MODELS = {
    "shakespeare-char": (4, 4, 128, 64, 6, 200),
    "gpt-10M": (6, 6, 384, 256, 4, 30),
}
WARMUP = 5
ROUNDS = 3


def _overrides(spec, data, global_batch, steps) -> list[str]:
    L, H, C, T, _, _ = spec
    return [f"--data.path={data}", f"--model.n_layer={L}", f"--model.n_head={H}",
            f"--model.n_embd={C}", f"--model.block_size={T}",
            f"--train.batch_size={global_batch}", f"--train.max_iters={steps}",
            "--train.eval_interval=0", "--train.final_eval=false",
            "--train.save_checkpoint=false", "--train.sample_tokens=0",
            "--train.progress=false", f"--train.log_interval={steps}"]


def worker_hpctrain(out: Path, args: list[str], independent: bool = False) -> None:
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    cfg = load_config("shakespeare-char",
                      args + [f"--train.out_dir=/tmp/hpctrain-bench-dp-{comm.rank}"])
    # independent: every rank trains alone on COMM_SELF, all at the same time.
    trainer = Trainer(cfg, World.create(MPI.COMM_SELF if independent else comm), verbose=False)
    result = trainer.fit()
    step_ms = comm.gather(1e3 * statistics.median(result.step_times[WARMUP:]), root=0)
    if comm.rank == 0:
        out.write_text(json.dumps({
            "step_ms": max(step_ms),
            "comm_wait_ms": 1e3 * trainer.dp.stats.wait_s / len(result.step_times),
            "buckets": len(trainer.dp.buckets)}))


def worker_ddp(out: Path, args: list[str]) -> None:
    from mpi4py import MPI

    from hpctrain.train.optim import build_optimizer, param_groups

    times = torch_ddp_step_times(args, lambda model, cfg: build_optimizer(
        param_groups(model, cfg.optim.weight_decay), cfg.optim, "cpu"))  # same fused AdamW
    if MPI.COMM_WORLD.rank == 0:
        out.write_text(json.dumps({"step_ms": 1e3 * statistics.median(times[WARMUP:])}))


def measure(spec, data) -> dict:
    L, H, C, T, b, steps = spec
    runs: dict[str, list[float]] = {k: [] for k in ("dp2", "dp1", "pair", "ddp2", "single2t")}
    comm_wait = []
    for _ in range(ROUNDS):
        r = run_worker(2, __file__, ["hpctrain", *_overrides(spec, data, 2 * b, steps)])
        runs["dp2"].append(r["step_ms"])
        comm_wait.append(r["comm_wait_ms"])
        runs["dp1"].append(run_worker(1, __file__, ["hpctrain", *_overrides(spec, data, b, steps)])["step_ms"])
        runs["pair"].append(run_worker(2, __file__, ["independent", *_overrides(spec, data, b, steps)])["step_ms"])
        runs["ddp2"].append(run_worker(2, __file__, ["ddp", *_overrides(spec, data, 2 * b, steps)])["step_ms"])
        _, stdout = timed_command(
            [sys.executable, str(ROOT / "perf" / "nanogpt_baseline.py"), "--data", str(data),
             "--max-iters", str(steps), "--batch-size", str(2 * b), "--no-eval",
             "--model", f"{L},{H},{C},{T}"], threads=2)
        runs["single2t"].append(json.loads(stdout.strip().splitlines()[-1])["step_ms_median"])
    best = {k: statistics.median(v) for k, v in runs.items()}
    tokens = {"dp2": 2 * b * T, "dp1": b * T, "pair": 2 * b * T, "ddp2": 2 * b * T,
              "single2t": 2 * b * T}
    tok_s = {k: tokens[k] / (best[k] / 1e3) for k in best}
    return {"per_rank_batch": b, "block_size": T, "steps": steps, "step_ms": best,
            "all_runs_ms": runs, "tokens_per_s": tok_s, "comm_wait_ms": statistics.median(comm_wait),
            "weak_scaling_efficiency": tok_s["dp2"] / (2 * tok_s["dp1"]),
            "contention_ceiling": tok_s["pair"] / (2 * tok_s["dp1"]),
            "communication_efficiency": tok_s["dp2"] / tok_s["pair"],
            "vs_ddp": tok_s["dp2"] / tok_s["ddp2"], "vs_single_2threads": tok_s["dp2"] / tok_s["single2t"]}


def main() -> None:
    quick = "--quick" in sys.argv
    data = shakespeare_dataset()
    results, rows = {}, []
    for name, spec in MODELS.items():
        if quick:
            spec = (*spec[:5], max(20, spec[5] // 4))
        r = results[name] = measure(spec, data)
        ts = r["tokens_per_s"]
        rows.append([name, r["per_rank_batch"], ts["dp1"], ts["pair"], ts["dp2"], ts["ddp2"],
                     ts["single2t"], r["weak_scaling_efficiency"], r["contention_ceiling"],
                     r["communication_efficiency"], r["vs_ddp"], r["vs_single_2threads"],
                     r["comm_wait_ms"]])
    print_table(f"Training throughput (tokens/s): median over {ROUNDS} interleaved rounds of the "
                "median step time",
                ["model", "b/rank", "DP=1", "2xDP=1 at once", "DP=2", "DDP gloo 2", "1 proc 2t",
                 "weak eff", "ceiling", "comm eff", "vs DDP", "vs 1p2t", "comm wait ms"], rows)
    eff = min(r["weak_scaling_efficiency"] for r in results.values())
    vs = min(r["vs_ddp"] for r in results.values())
    print(f"\ntargets: efficiency >= 0.95: worst {eff:.3f} -> {'MET' if eff >= 0.95 else 'NOT MET'};"
          f" >= 1.0x torch DDP: worst {vs:.2f}x -> {'MET' if vs >= 1.0 else 'NOT MET'}")
    write_result("dp", {"models": results, "quick": quick,
                        "targets": {"efficiency": 0.95, "vs_ddp": 1.0},
                        "met": eff >= 0.95 and vs >= 1.0})


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        if rest[0] == "ddp":
            worker_ddp(out, rest[1:])
        else:
            worker_hpctrain(out, rest[1:], independent=rest[0] == "independent")
    else:
        main()
