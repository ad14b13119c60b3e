"""Pipeline parallelism: measured bubble vs theory, activation memory of 1F1B vs GPipe,
and each of our schedules against torch.distributed.pipelining's schedule of the same kind.

In one run (8-layer GPT, width 256, block 128, 2 rows per micro-batch, 1 thread/rank):
  A. For p = 2, 4 stages and m = 4, 8, 16 micro-batches, 1F1B and GPipe: the share of
     each stage's pipeline time spent blocked on a neighbour (the executor's receive
     waits, mean over stages) against theory (p - 1) / (m + p - 1), and the pipeline
     efficiency (below). Median over the steps of one run, with min and max.
  B. Peak activation memory per stage within a step: the heap in use (glibc
     ``mallinfo2``: malloc'd + mmap'd bytes) sampled after every forward, minus the heap
     at the start of the step (parameters, gradient buffers and optimizer state exist
     already). Target: 1F1B <= (p/m) x GPipe (+10%), worst stage vs worst stage.
  C. Step time of each of our schedules against torch's own schedule of the same kind
     (gloo), p = 2 and 4, m = 8: 1F1B vs ``Schedule1F1B``, interleaved with 2 chunks per
     stage vs ``ScheduleInterleaved1F1B`` with 2 stages per rank (the same layers on
     the same ranks: chunk g on rank g mod p), GPipe vs ``ScheduleGPipe``. Same stage
     modules, micro-batches, loss, and fused AdamW step (timed in the step). ROUNDS
     rounds, each running every job once in turn (drift on this machine hits all
     alike); a job's figure is the median over its steps; the table gives the median
     over the rounds with [min, max], and the speedup is the median of the per-round
     ratios torch / ours. Target: 1F1B >= 1.2x torch. torch's stages do not keep the
     tied embedding in sync; ours do (two small messages per step, in our step time).
     zb-h1 runs against ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's
     ZB-H1).

The zero-bubble schedules against torch's 1F1B and its zero-bubble schedules, with the
measured bubble against the simulator's: ``perf/bench_zero_bubble.py``.

Pipeline efficiency = (forward + backward seconds of the busiest stage) / (seconds of
the pipeline phase of the step: from the common start after a barrier to the end of the
slowest stage's last pass), both without the optimizer step. A stage's passes run within
its own phase, so it is at most 1 by construction; 1 - efficiency is the time the
busiest stage is not computing (bubble, messages, scheduling). Compute is timed around
each pass: ``PipelineStats.compute_s`` in ours, ``forward_one_chunk`` /
``backward_one_chunk`` and the loss function in torch's.

4 ranks share this machine's 2 cores, so at p = 4 two stages run on one core: compute
slows while both are busy and speeds up while one waits, which flatters the bubble at
p = 4 (noted beside the numbers).

    python perf/bench_pipeline.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf import pipeline_workers  # noqa: E402
from perf.common import (bench_parser, fmt, fmt_spread, print_table, run_worker,  # noqa: E402
                         write_result)
from perf.pipeline_workers import (MODEL, ROUNDS, ROWS, STEPS, TORCH_SCHEDULES,  # noqa: E402
                                   VIRTUAL, WARMUP, bubble_theory)
from hpctrain.sizes import MiB  # noqa: E402

TARGET_VS_TORCH = 1.2  # for 1F1B
VS_TORCH = ("1f1b", "interleaved", "gpipe", "zb-h1")
WORKER = Path(pipeline_workers.__file__)


# ---------------------------------------------------------------------------- driver

def part_bubble(micro: list[int], steps: int) -> tuple[list[dict], list[list], list[list]]:
    records, rows_a, rows_b = [], [], []
    for p in (2, 4):
        for m in micro:
            per = {}
            for kind in ("1f1b", "gpipe"):
                r = run_worker(p, WORKER, ["ours-memory", kind, str(m), str(steps)])
                act = [max(s["act_bytes"]) for s in r["stages"]]
                per[kind] = {"per_step": {k: r[k] for k in ("step_s", "pipe_s",
                                                            "busiest_compute_s",
                                                            "efficiency", "bubble")},
                             "bubble_theory": bubble_theory(p, m), "act_bytes": act,
                             "act_bytes_max": max(act)}
                rows_a.append([p, m, kind, bubble_theory(p, m), fmt_spread(r["bubble"]),
                               fmt_spread(r["efficiency"]), fmt_spread(r["step_s"], 1e3)])
            ratio = per["1f1b"]["act_bytes_max"] / per["gpipe"]["act_bytes_max"]
            rows_b.append([p, m, per["1f1b"]["act_bytes_max"] / MiB,
                           per["gpipe"]["act_bytes_max"] / MiB, ratio, p / m,
                           "met" if ratio <= 1.1 * p / m else "MISSED"])
            records.append({"p": p, "m": m, **per, "act_ratio": ratio, "act_target": p / m})
    return records, rows_a, rows_b


def part_vs_torch(m: int, steps: int, rounds: int) -> list[dict]:
    records = []
    for p in (2, 4):
        runs = {kind: {"ours": [], "torch": []} for kind in VS_TORCH}
        for _ in range(rounds):  # every job once per round, so drift hits all alike
            for kind in VS_TORCH:
                for impl in ("ours", "torch"):
                    r = run_worker(p, WORKER, [impl, kind, str(m), str(steps)],
                                   retries=1 if impl == "torch" else 0)
                    runs[kind][impl].append(r)
        for kind, by_impl in runs.items():
            rec = {"p": p, "m": m, "schedule": kind,
                   "virtual": VIRTUAL if kind == "interleaved" else 1,
                   "torch_class": TORCH_SCHEDULES[kind]}
            for impl, rs in by_impl.items():
                rec[impl] = {k: [statistics.median(r[k]) for r in rs]
                             for k in ("step_s", "pipe_s", "busiest_compute_s", "efficiency")}
            rec["speedup_per_round"] = [t / o for t, o in zip(rec["torch"]["step_s"],
                                                              rec["ours"]["step_s"])]
            rec["speedup"] = statistics.median(rec["speedup_per_round"])
            records.append(rec)
            print(f"  p={p} {kind}: ours {fmt_spread(rec['ours']['step_s'], 1e3)} ms, "
                  f"torch {fmt_spread(rec['torch']['step_s'], 1e3)} ms", flush=True)
    return records


def vs_torch_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        target = ("met" if r["speedup"] >= TARGET_VS_TORCH else "MISSED") \
            if r["schedule"] == "1f1b" else "-"
        name = r["schedule"] + (f" v={r['virtual']}" if r["virtual"] > 1 else "")
        rows.append([r["p"], r["m"], name, r["torch_class"],
                     fmt_spread(r["ours"]["step_s"], 1e3), fmt_spread(r["torch"]["step_s"], 1e3),
                     fmt_spread(r["speedup_per_round"]), target,
                     fmt_spread(r["ours"]["efficiency"]), fmt_spread(r["torch"]["efficiency"])])
    return rows


VS_TORCH_COLUMNS = ["p", "m", "schedule", "torch schedule", "ours ms", "torch ms",
                    "speedup", f"target {TARGET_VS_TORCH}x", "ours eff", "torch eff"]


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    steps = 3 if args.quick else STEPS
    micro = [4, 8] if args.quick else [4, 8, 16]
    rounds = 1 if args.quick else ROUNDS
    print(f"A+B. bubble and activation memory (p = 2, 4; m = {micro}; {steps} steps)",
          flush=True)
    bubble, rows_a, rows_b = part_bubble(micro, steps)
    print_table("A. bubble: share of the pipeline phase blocked on a neighbour (mean over "
                "stages) and efficiency (busiest stage's compute / phase); median [min, max] "
                "over steps",
                ["p", "m", "schedule", "theory", "measured", "efficiency", "step ms"], rows_a)
    print_table("B. peak activation memory per step, worst stage (MiB)",
                ["p", "m", "1F1B", "GPipe", "ratio", "p/m", "target"], rows_b)
    print(f"\nC. our schedules vs torch.distributed.pipelining's (m = 8, {rounds} round(s))",
          flush=True)
    vs_torch = part_vs_torch(8, steps, rounds)
    print_table(f"C. step time (ms, optimizer included) vs torch's schedule of the same kind "
                f"(gloo), same stages; median [min, max] over {rounds} round(s); speedup = "
                "torch / ours per round; eff = busiest stage's compute / pipeline phase",
                VS_TORCH_COLUMNS, vs_torch_rows(vs_torch))
    worst = min(r["speedup"] for r in vs_torch if r["schedule"] == "1f1b")
    print(f"\ntarget: our 1F1B >= {fmt(TARGET_VS_TORCH)}x torch's Schedule1F1B: worst "
          f"{fmt(worst)}x -> {'MET' if worst >= TARGET_VS_TORCH else 'NOT MET'}")
    write_result("pipeline", {"quick": args.quick, "model": MODEL, "rows_per_micro": ROWS,
                              "steps": steps, "warmup": WARMUP, "rounds": rounds,
                              "virtual": VIRTUAL, "bubble": bubble, "vs_torch": vs_torch,
                              "target_vs_torch": TARGET_VS_TORCH,
                              "met": worst >= TARGET_VS_TORCH}, smoke=args.quick)


if __name__ == "__main__":
    main(sys.argv[1:])
