"""Zero-bubble pipelines: our zb-h1 and zbv against torch.distributed.pipelining's 1F1B
and its zero-bubble schedules of the same kind; the bubble measured against the
simulator's; and the ceiling: the most any schedule could gain over torch's 1F1B with
the pass times measured here.

In one run, p = 2 stages, m = 4 and 8 micro-batches (the model of
``perf/pipeline_workers.py``: 8-layer GPT, width 256, block 128, 2 rows per micro-batch,
1 thread per rank), seven jobs: our zb-h1 and zbv with their equal-time orders, our zbv
with its order built for the pass times measured by the round's equal-time zbv run
(``zbv timed``: ``--parallel.pass_times``), torch's ``ScheduleInterleavedZeroBubble``
with one stage per rank (its ZB-H1), torch's ``ScheduleZBVZeroBubble`` (two stages per
rank in a V, as ours), torch's ``Schedule1F1B`` and our 1F1B. Same stage modules (our
``PipelineStage``: zbv's are cut in a V for both), micro-batches, loss and fused AdamW step
(timed in the step). ROUNDS rounds, each running every job once in turn (drift on this
machine hits all alike); a job's figure is the median over its steps; tables give the
median over rounds with [min, max]; a speedup is the median of the per-round ratios
theirs / ours.

- **Speed.** Targets: each of ours >= 1.2x torch's 1F1B and >= 1.0x torch's schedule of
  the same kind.
- **Bubble.** Idle share of all stages, 1 - (the stages' compute summed) / (p x the
  pipeline phase), per step, against the simulator's prediction for the same schedule
  with each stage's passes taking their measured time (forward, B, W per micro-batch;
  zbv: the mean of its two chunks) and in units (``schedules.unit_times``).
- **Memory.** Once, at m = 8: the peak activation bytes of each stage within a step
  (the heap in use after every forward, less the heap at the step's start, as
  ``bench_pipeline.py`` part B) for 1F1B, zb-h1 and zbv, worst stage against 1F1B's,
  beside the simulator's most micro-batches a stage holds until their last backward pass
  (W; a zbv chunk counts half: it holds half a stage's layers).
- **Ceiling.** A schedule without any bubble takes the optimizer step plus its busiest
  stage's compute (``ideal``, per step from the same job). torch's 1F1B step over that is
  the most the schedule could reach: with our split backward as measured (per zero-bubble
  schedule), and with a free split (our 1F1B's compute: a fused backward). The split's
  cost is the busiest stage's compute of zb-h1 over that of our 1F1B.

    python perf/bench_zero_bubble.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf import pipeline_workers  # noqa: E402
from perf.common import bench_parser, fmt, fmt_spread, print_table, run_worker, write_result  # noqa: E402
from perf.pipeline_workers import (MODEL, ROUNDS, ROWS, STEPS, WARMUP,  # noqa: E402
                                   measured_idle, measured_pass_times, predicted_idle)
from hpctrain.sizes import MiB  # noqa: E402

P, MICRO = 2, (4, 8)
OURS = ("zb-h1", "zbv", "zbv timed")
"""Our zero-bubble jobs: a schedule, ``timed`` when its order is built for the pass times
the round's equal-time run of it measured (after it in ``JOBS``)."""
JOBS = tuple(("ours", k) for k in OURS) + (("torch", "zb-h1"), ("torch", "zbv"),
                                           ("torch", "1f1b"), ("ours", "1f1b"))
TARGET_VS_TORCH_1F1B, TARGET_VS_SAME_KIND = 1.2, 1.0
WORKER = Path(pipeline_workers.__file__)


def schedule_of(job: str) -> str:
    return job.split()[0]


def against(kind: str) -> dict[str, float | None]:
    """What our job ``kind`` is compared with, and the target speedup (None: none)."""
    return {"torch 1f1b": TARGET_VS_TORCH_1F1B,
            f"torch {schedule_of(kind)}": TARGET_VS_SAME_KIND, "ours 1f1b": None}


def ideal_step(run: dict) -> float:
    """The job's step without any bubble: optimizer plus the busiest stage's compute,
    median over its steps."""
    return statistics.median(s - p + c for s, p, c in zip(run["step_s"], run["pipe_s"],
                                                          run["busiest_compute_s"]))


def summarize(runs: dict[tuple, list[dict]], m: int, order_times: list[str]) -> dict:
    """One record for (P, m) from every job's runs, one run per round; ``order_times``:
    the pass times ``zbv timed`` was ordered for, per round."""
    from hpctrain.parallel.pipeline import schedules as S

    rec: dict = {"p": P, "m": m, "jobs": {}, "zbv_timed_pass_times": order_times}
    for (impl, kind), rs in runs.items():
        rec["jobs"][f"{impl} {kind}"] = {
            **{k: [statistics.median(r[k]) for r in rs]
               for k in ("step_s", "pipe_s", "busiest_compute_s", "efficiency")},
            "ideal_s": [ideal_step(r) for r in rs]}
    jobs = rec["jobs"]

    def per_round(num: str, den: str, key: str = "step_s") -> list[float]:
        return [a / b for a, b in zip(jobs[num][key], jobs[den][key])]

    rec["speedup"] = {kind: {name: per_round(name, f"ours {kind}") for name in against(kind)}
                      for kind in OURS}
    rec["bubble"] = {kind: {
        "measured": [statistics.median(measured_idle(r["stages"], i)
                                       for i in range(len(r["step_s"])))
                     for r in runs[("ours", kind)]],
        "predicted": [predicted_idle(schedule_of(kind), r["stages"], m,
                                     order_times[i] if kind.endswith("timed") else "")
                      for i, r in enumerate(runs[("ours", kind)])],
        "predicted_unit": S.predicted_bubble(schedule_of(kind), P, m)}
        for kind in (*OURS, "1f1b")}
    torch_1f1b = jobs["torch 1f1b"]["step_s"]
    rec["ceiling"] = {
        **{kind: [t / i for t, i in zip(torch_1f1b, jobs[f"ours {kind}"]["ideal_s"])]
           for kind in OURS},
        "free split": [t / i for t, i in zip(torch_1f1b, jobs["ours 1f1b"]["ideal_s"])],
        "split cost": per_round("ours zb-h1", "ours 1f1b", "busiest_compute_s")}
    return rec


MEMORY_M = 8
MEMORY_KINDS = ("1f1b", "zb-h1", "zbv")


def held_per_stage(kind: str, m: int) -> list[float]:
    """The simulator's most micro-batches each stage holds until their last backward
    pass, in whole-stage micro-batches (a zbv chunk is half a stage)."""
    from hpctrain.parallel.pipeline import schedules as S

    sim = S.simulate(kind, P, m)
    return [n / S.chunks_per_stage(kind) for n in sim.peak_in_flight]


def measure_memory(steps: int) -> dict:
    """Worst stage's peak activation bytes of each schedule at ``MEMORY_M``."""
    out = {}
    for kind in MEMORY_KINDS:
        print(f"  memory: {kind}", flush=True)
        r = run_worker(P, WORKER, ["ours-memory", kind, str(MEMORY_M), str(steps)])
        per_stage = [max(s["act_bytes"]) for s in r["stages"]]
        out[kind] = {"act_bytes": per_stage, "held": held_per_stage(kind, MEMORY_M)}
    base = out["1f1b"]
    for rec in out.values():
        rec["vs_1f1b"] = max(rec["act_bytes"]) / max(base["act_bytes"])
        rec["predicted_vs_1f1b"] = max(rec["held"]) / max(base["held"])
    return out


def memory_rows(memory: dict) -> list[list]:
    return [[kind, " / ".join(fmt(b / MiB) for b in r["act_bytes"]),
             " / ".join(fmt(h) for h in r["held"]), fmt(r["vs_1f1b"]),
             fmt(r["predicted_vs_1f1b"])] for kind, r in memory.items()]


MEMORY_COLUMNS = ["schedule", "peak activations per stage (MiB)",
                  "held per stage (simulator)", "worst vs 1F1B", "predicted"]


def measure(steps: int, rounds: int) -> list[dict]:
    records = []
    for m in MICRO:
        runs: dict[tuple, list[dict]] = {job: [] for job in JOBS}
        order_times = []
        for r in range(rounds):
            for impl, kind in JOBS:
                args = [impl, schedule_of(kind), str(m), str(steps)]
                if kind.endswith("timed"):
                    order_times.append(measured_pass_times(
                        runs[(impl, schedule_of(kind))][-1]["stages"]))
                    args.append(order_times[-1])
                print(f"  m={m} round {r + 1}/{rounds}: {impl} {kind} {args[4:]}", flush=True)
                runs[(impl, kind)].append(run_worker(P, WORKER, args,
                                                     retries=1 if impl == "torch" else 0))
        records.append(summarize(runs, m, order_times))
    return records


def speed_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        for kind in OURS:
            for name, target in against(kind).items():
                ratios = r["speedup"][kind][name]
                verdict = "-" if target is None else \
                    f"{fmt(target)}x {'met' if statistics.median(ratios) >= target else 'MISSED'}"
                rows.append([r["p"], r["m"], kind, name,
                             fmt_spread(r["jobs"][f"ours {kind}"]["step_s"], 1e3),
                             fmt_spread(r["jobs"][name]["step_s"], 1e3), fmt_spread(ratios),
                             verdict])
    return rows


def bubble_rows(records: list[dict]) -> list[list]:
    return [[r["p"], r["m"], kind, fmt_spread(b["measured"]), fmt_spread(b["predicted"]),
             fmt(b["predicted_unit"])] for r in records for kind, b in r["bubble"].items()]


def ceiling_rows(records: list[dict]) -> list[list]:
    rows = []
    for r in records:
        c, jobs = r["ceiling"], r["jobs"]
        rows.append([r["p"], r["m"], fmt_spread(jobs["torch 1f1b"]["step_s"], 1e3),
                     *(fmt_spread(c[kind]) for kind in OURS), fmt_spread(c["free split"]),
                     fmt_spread(c["split cost"])])
    return rows


SPEED_COLUMNS = ["p", "m", "ours", "against", "ours ms", "their ms", "speedup", "target"]
BUBBLE_COLUMNS = ["p", "m", "schedule", "measured idle", "predicted (measured passes)",
                  "predicted (unit passes)"]
CEILING_COLUMNS = ["p", "m", "torch 1F1B ms", *(f"ceiling {k}" for k in OURS),
                   "ceiling, free split", "split cost"]


def targets_met(records: list[dict]) -> dict[str, bool]:
    return {f"{kind} vs {name}": all(statistics.median(r["speedup"][kind][name]) >= target
                                     for r in records)
            for kind in OURS for name, target in against(kind).items() if target is not None}


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    steps = 3 if args.quick else STEPS
    rounds = 1 if args.quick else ROUNDS
    print(f"zero bubble: p = {P}, m = {list(MICRO)}, {rounds} round(s) of {len(JOBS)} jobs",
          flush=True)
    records = measure(steps, rounds)
    memory = measure_memory(steps)
    print_table("speed: step ms (optimizer included), median [min, max] over rounds; "
                "speedup = theirs / ours per round", SPEED_COLUMNS, speed_rows(records))
    print_table("bubble: idle share of all stages, measured vs the simulator's prediction",
                BUBBLE_COLUMNS, bubble_rows(records))
    print_table("ceiling: torch's 1F1B step / a step without bubble (optimizer + busiest "
                "stage's compute), with our split as measured and with a free split; split "
                "cost = zb-h1's busiest compute / our 1F1B's", CEILING_COLUMNS,
                ceiling_rows(records))
    print_table(f"memory (m = {MEMORY_M}): peak activation bytes per stage within a step, "
                "and the simulator's most micro-batches held until W", MEMORY_COLUMNS,
                memory_rows(memory))
    met = targets_met(records)
    for name, ok in met.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    write_result("zero_bubble", {"quick": args.quick, "model": MODEL, "rows_per_micro": ROWS,
                                 "p": P, "steps": steps, "warmup": WARMUP, "rounds": rounds,
                                 "records": records, "memory": memory,
                                 "memory_m": MEMORY_M, "targets": {
                                     "torch 1f1b": TARGET_VS_TORCH_1F1B,
                                     "torch same kind": TARGET_VS_SAME_KIND},
                                 "met": met}, smoke=args.quick)


if __name__ == "__main__":
    main(sys.argv[1:])
