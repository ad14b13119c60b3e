"""ZeRO: memory per rank against the paper's formulas, step time against plain data
parallelism and torch's ZeroRedundancyOptimizer, and the largest model under a memory cap.

In one run, on the shakespeare data (training steps are real):
  A. per-rank model-state bytes (parameters + gradients + optimizer state, from the
     trainer's memory accounting) for stages 0-3, fp32 and bf16, at N = 2 and 4, against
     the ZeRO formulas (fp32: 16, 8+8/N, 4+12/N, 16/N bytes per parameter; bf16 mixed:
     16, 4+12/N, 2+14/N, 16/N). Target: within 5%; communication buffers are reported
     beside them (bounded by the bucket caps).
  B. step time of each stage relative to stage 0 (plain DP) in the same run (median
     over the steps of the slowest rank's step time, with min and max), and ZeRO-1
     against torch's ZeroRedundancyOptimizer (gloo, wrapped in DDP, as its docs pair
     them) on the same model, data, sampler and ranks, twice: with its defaults and with
     ``parameters_as_bucket_view=True`` (parameters packed into a bucket per rank, so
     the broadcast after each step sends one message per rank instead of one per
     parameter). A's jobs time 4 steps after 4 warm-up steps; these 8 after 4, in
     ROUNDS rounds, every job once per round; median over the rounds [min, max].
  C. the largest GPT (16 layers, width 128-640 in steps of 32) that trains two steps
     on 4 ranks while every rank's peak resident memory grows by at most CAP_MIB over
     what the process held before the model was built, stage 0 vs stage 3 (binary
     search, one run per width). Target: ZeRO-3 trains >= 3x the parameters of DP. glibc is told to return large blocks to the OS at once
     (MALLOC_MMAP_THRESHOLD_), so a freed ZeRO-3 gather does not linger in the RSS, and
     a tiny model runs first so torch's lazily loaded kernels are not counted.

    python perf/bench_zero.py --shakespeare PATH [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (bench_parser, fmt, fmt_spread,  # noqa: E402
                         largest_that_fits, print_table,
                         run_worker, scratch_dir, shakespeare_dataset,
                         torch_ddp_step_times,
                         worker_args, write_result)
from hpctrain.sizes import MiB  # noqa: E402

MODEL = (6, 6, 384, 128)  # layers, heads, width, block: ~10.7M parameters
ROWS_PER_RANK = 2
STEPS, WARMUP = 12, 4  # ZeRO-1 vs torch: 8 timed steps per job
STEPS_MEMORY = 8  # the memory sweep: its step times are secondary, 4 timed steps
ROUNDS = 3
# torch's ZeroRedundancyOptimizer: its defaults, then its flat parameter buffer.
TORCH_ZERO = {"torch": {}, "torch_bucket_view": {"parameters_as_bucket_view": True}}
CAP_MIB = 256
CAP_LAYERS, CAP_BLOCK, CAP_HEAD = 16, 64, 32
# Searched widths: 128-640 (stage 0 fitted 224 and stage 3 416 under the cap so far);
# a stage that fits the top one is reported as such.
CAP_WIDTHS = list(range(128, 641, 32))


def _overrides(data, spec, ranks, steps, stage, dtype) -> list[str]:
    L, H, C, T = spec
    return [f"--data.path={data}", f"--model.n_layer={L}", f"--model.n_head={H}",
            f"--model.n_embd={C}", f"--model.block_size={T}",
            f"--train.batch_size={ROWS_PER_RANK * ranks}", f"--train.max_iters={steps}",
            f"--parallel.zero={stage}", f"--train.dtype={dtype}", "--data.verify=false",
            "--train.eval_interval=0", "--train.final_eval=false",
            "--train.save_checkpoint=false", "--train.sample_tokens=0",
            "--train.progress=false", f"--train.log_interval={steps}"]


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _warm_up_libraries() -> None:
    """Run a tiny model once so that code torch loads lazily on first use (oneDNN
    kernels, the fused AdamW, thread pools: ~85 MiB here) is not counted as the model's."""
    import torch

    from hpctrain.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=8))
    x = torch.zeros(1, 8, dtype=torch.long)
    model(x, x).backward()
    torch.optim.AdamW(model.parameters(), fused=True).step()


def worker_train(out: Path, args: list[str], measure_peak: bool) -> None:
    from mpi4py import MPI

    from hpctrain.comm.world import World
    from hpctrain.config import load_config
    from hpctrain.train.trainer import Trainer

    comm = MPI.COMM_WORLD
    cfg = load_config("shakespeare-char", [*args, f"--train.out_dir={scratch_dir('zero', comm)}"])
    world = World.create(comm)
    if measure_peak:
        _warm_up_libraries()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
        base = _rss_kib("VmRSS")
    trainer = Trainer(cfg, world, verbose=False)
    result = trainer.fit()
    growth = (_rss_kib("VmHWM") - base) * 1024 if measure_peak else 0
    mem = trainer.memory()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    times = comm.gather(result.step_times[WARMUP:] or result.step_times, root=0)
    growth = comm.gather(growth, root=0)
    if comm.rank == 0:
        step_ms = slowest_rank_ms(times)
        out.write_text(json.dumps({"step_ms": statistics.median(step_ms),
                                   "step_ms_all": step_ms, "params": n_params,
                                   "memory": mem.to_dict(), "peak_rss_growth": max(growth),
                                   "final_loss": result.losses[-1]}))


def slowest_rank_ms(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's step time (ms): the step of a synchronous job."""
    return [1e3 * max(step) for step in zip(*per_rank)]


def worker_zro(out: Path, variant: str, args: list[str]) -> None:
    """torch's ZeRO-1: DDP allreduce + ZeroRedundancyOptimizer (sharded AdamW, broadcast)."""
    import torch
    from mpi4py import MPI
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def zero_redundancy_adamw(model, cfg):
        o = cfg.optim
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                       lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                       weight_decay=o.weight_decay, fused=True,
                                       **TORCH_ZERO[variant])

    times = MPI.COMM_WORLD.gather(torch_ddp_step_times(args, zero_redundancy_adamw)[WARMUP:],
                                  root=0)
    if MPI.COMM_WORLD.rank == 0:
        step_ms = slowest_rank_ms(times)
        out.write_text(json.dumps({"step_ms": statistics.median(step_ms),
                                   "step_ms_all": step_ms}))


def part_memory_and_speed(data, quick: bool) -> tuple[list[dict], list[list]]:
    records, rows = [], []
    steps = STEPS // 2 if quick else STEPS_MEMORY
    for n in (2, 4):
        base_ms = {}
        for dtype in ("fp32", "bf16"):
            for stage in (0, 1, 2, 3):
                r = run_worker(n, __file__, ["train", *_overrides(data, MODEL, n, steps,
                                                                  stage, dtype)])
                from hpctrain.parallel.memory import zero_formula

                per_param = r["memory"]["model_state"] / r["params"]
                formula = zero_formula(stage, dtype, n)
                base_ms.setdefault(dtype, r["step_ms"])
                rec = {"ranks": n, "stage": stage, "dtype": dtype, **r,
                       "bytes_per_param": per_param, "formula": formula,
                       "vs_formula": per_param / formula,
                       "step_vs_stage0": r["step_ms"] / base_ms[dtype]}
                records.append(rec)
                rows.append([n, dtype, stage, per_param, formula, rec["vs_formula"],
                             r["memory"]["comm_buffers"] / MiB,
                             fmt_spread(r["step_ms_all"]), rec["step_vs_stage0"]])
                print(f"  N={n} {dtype} stage {stage}: {fmt(per_param)} B/param "
                      f"(formula {fmt(formula)}), {fmt_spread(r['step_ms_all'])} ms/step",
                      flush=True)
    return records, rows


def part_vs_torch(data, quick: bool) -> list[dict]:
    out = []
    steps = STEPS // 2 if quick else STEPS
    for n in (2, 4):
        args = _overrides(data, MODEL, n, steps, 1, "fp32")
        all_ms = {"hpctrain": [], **{v: [] for v in TORCH_ZERO}}
        for _ in range(1 if quick else ROUNDS):  # every job once per round; medians count
            all_ms["hpctrain"].append(run_worker(n, __file__, ["train", *args])["step_ms"])
            for variant in TORCH_ZERO:
                all_ms[variant].append(run_worker(n, __file__, [f"zro-{variant}", *args],
                                                  retries=1)["step_ms"])
        med = {k: statistics.median(v) for k, v in all_ms.items()}
        out.append({"ranks": n, "hpctrain_zero1_ms": med["hpctrain"],
                    "torch_zro_ms": med["torch"],
                    "torch_zro_bucket_view_ms": med["torch_bucket_view"],
                    "speedup": med["torch"] / med["hpctrain"],
                    "speedup_bucket_view": med["torch_bucket_view"] / med["hpctrain"],
                    "all_ms": all_ms})
        print(f"  N={n}: ZeRO-1 {fmt_spread(all_ms['hpctrain'])} ms/step; "
              f"ZeroRedundancyOptimizer {fmt_spread(all_ms['torch'])}, with "
              f"parameters_as_bucket_view {fmt_spread(all_ms['torch_bucket_view'])}", flush=True)
    return out


def vs_torch_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        ours = r["all_ms"]["hpctrain"]
        for variant, label in (("torch", "defaults"),
                               ("torch_bucket_view", "parameters_as_bucket_view=True")):
            theirs = r["all_ms"].get(variant)
            if not theirs:
                continue
            rows.append([r["ranks"], label, fmt_spread(ours), fmt_spread(theirs),
                         statistics.median(theirs) / statistics.median(ours)])
    return rows


def _fits(data, width: int, stage: int) -> tuple[bool, dict]:
    spec = (CAP_LAYERS, width // CAP_HEAD, width, CAP_BLOCK)
    # Peak RSS counts every page a rank touches. With the shared-memory allreduce each
    # rank also touches half of every peer's gradient buckets, so a node's one copy of
    # them would be counted up to 2.5 times; MPI keeps each rank's buckets private, so
    # stage 0 is measured on that path (its memory is the same, its RSS is not inflated).
    args = ["train-peak", *_overrides(data, spec, 4, 2, stage, "fp32"),
            *(["--comm.transport=mpi"] if stage == 0 else [])]
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
    r = run_worker(4, __file__, args, env=env, timeout=900)
    return r["peak_rss_growth"] <= CAP_MIB * MiB, r


def part_capacity(data) -> dict:
    """Largest width that fits, per stage."""
    return {stage: largest_that_fits(f"stage {stage}", CAP_WIDTHS,
                                     lambda width, stage=stage: _fits(data, width, stage))
            for stage in (0, 3)}


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__, shakespeare=True).parse_args(argv)
    quick = args.quick
    data = shakespeare_dataset(args.shakespeare)
    print("A+B. memory and step time per stage (model 6L/6H/384, block 128, "
          f"{ROWS_PER_RANK} rows per rank)", flush=True)
    records, rows = part_memory_and_speed(data, quick)
    print_table("Per-rank model-state bytes per parameter vs the ZeRO formulas; step time",
                ["ranks", "dtype", "stage", "B/param", "formula", "ratio", "comm MiB",
                 "step ms", "vs stage 0"], rows)
    print("\nB. ZeRO-1 vs torch ZeroRedundancyOptimizer (gloo), same model and batches",
          flush=True)
    torch_rows = part_vs_torch(data, quick)
    print_table("ZeRO-1 step time (ms), median [min, max] over interleaved rounds; speedup = "
                "torch / ours (medians)",
                ["ranks", "ZeroRedundancyOptimizer", "hpctrain ZeRO-1 ms", "torch ms",
                 "speedup"], vs_torch_rows(torch_rows))
    capacity = {}
    if not quick:
        print(f"\nC. largest model training on 4 ranks under {CAP_MIB} MiB per rank", flush=True)
        capacity = part_capacity(data)
        print_table(f"Largest GPT ({CAP_LAYERS} layers) under {CAP_MIB} MiB peak RSS growth "
                    "per rank, 4 ranks",
                    ["stage", "width", "params", "peak MiB"],
                    [[s, c["width"], c["params"], c["peak_rss_growth"] / MiB]
                     for s, c in capacity.items() if c])
    worst = max(abs(r["vs_formula"] - 1) for r in records)
    ratio = capacity[3]["params"] / capacity[0]["params"] if capacity else None
    print(f"\ntargets: model state within 5% of the formulas: worst deviation {fmt(worst)} "
          f"-> {'MET' if worst <= 0.05 else 'NOT MET'}")
    if ratio is not None:
        print(f"ZeRO-3 trains >= 3x the parameters of DP under the cap: {fmt(ratio)}x -> "
              f"{'MET' if ratio >= 3 else 'NOT MET'}")
    write_result("zero", {"quick": quick, "model": MODEL, "rows_per_rank": ROWS_PER_RANK,
                          "memory_and_speed": records, "vs_torch_zero": torch_rows,
                          "capacity": {"cap_mib": CAP_MIB, "by_stage": capacity,
                                       "ratio": ratio},
                          "worst_formula_deviation": worst}, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        kind, args = rest[0], rest[1:]
        if kind.startswith("zro-"):
            worker_zro(out, kind[len("zro-"):], args)
        else:
            worker_train(out, args, measure_peak=kind == "train-peak")
    else:
        main(rest)
