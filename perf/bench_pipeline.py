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
  D. Zero bubble at p = 2, m = 4 and 8: our zb-h1 against torch's 1F1B (target 1.2x),
     torch's zero-bubble schedule (target 1.0x) and our 1F1B, ROUNDS rounds of every job
     in turn. The bubble of our zb-h1 and 1F1B measured (1 - the stages' compute summed
     / (p x the pipeline phase), per step) against the simulator's prediction for the
     same schedule, with each stage's passes taking their measured time (forward, B, W,
     per micro-batch) and in units (``schedules.unit_times``: F = B = W, the first
     stage's B empty and its W two units).

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

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (bench_parser, fmt, fmt_spread, init_gloo, print_table,  # noqa: E402
                         run_worker, worker_args, write_result)

MODEL = dict(vocab_size=96, block_size=128, n_layer=8, n_head=8, n_embd=256)
ROWS = 2  # per micro-batch
WARMUP, STEPS, ROUNDS = 2, 5, 3
VIRTUAL = 2  # chunks per stage of the interleaved schedules
TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "gpipe": "ScheduleGPipe", "zb-h1": "ScheduleInterleavedZeroBubble"}
TARGET_VS_TORCH = 1.2  # for 1F1B
ZB_P, ZB_MICRO = 2, (4, 8)
ZB_JOBS = (("ours", "zb-h1"), ("torch", "zb-h1"), ("torch", "1f1b"), ("ours", "1f1b"))
ZB_TARGETS = {"torch 1f1b": TARGET_VS_TORCH, "torch zb-h1": 1.0, "ours 1f1b": None}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


_LIBC = None


def heap_in_use() -> int:
    """Bytes the C heap has handed out: small blocks in arenas plus mmap'd large ones.
    Called after every forward: the library is opened once."""
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL("libc.so.6")
        _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


# ----------------------------------------------------------------- pure bookkeeping

def pipeline_efficiency(compute_s: list[float], pipe_s: list[float]) -> float:
    """Busiest stage's compute / the pipeline phase (the slowest stage's), one step.
    Each stage's compute lies within its own phase, so the result is <= 1."""
    return max(compute_s) / max(pipe_s)


def combine_stages(stages: list[dict]) -> dict:
    """Per-step figures of the whole pipeline from every stage's per-step lists
    (``step_s``, ``pipe_s``, ``compute_s``, optionally ``bubble_s``)."""
    n = len(stages[0]["step_s"])
    out = {"step_s": [max(s["step_s"][i] for s in stages) for i in range(n)],
           "pipe_s": [max(s["pipe_s"][i] for s in stages) for i in range(n)],
           "busiest_compute_s": [max(s["compute_s"][i] for s in stages) for i in range(n)]}
    out["efficiency"] = [pipeline_efficiency([s["compute_s"][i] for s in stages],
                                             [s["pipe_s"][i] for s in stages])
                         for i in range(n)]
    if "bubble_s" in stages[0]:
        out["bubble"] = [statistics.fmean(s["bubble_s"][i] / s["pipe_s"][i] for s in stages)
                         for i in range(n)]
    return out


def measured_idle(stages: list[dict], step: int) -> float:
    """Idle share of all stages in one step: 1 - compute summed / (p x pipeline phase),
    the simulator's ``bubble``."""
    phase = max(s["pipe_s"][step] for s in stages)
    return 1.0 - sum(s["compute_s"][step] for s in stages) / (len(stages) * phase)


def predicted_idle(kind: str, stages: list[dict], m: int) -> float:
    """The simulator's bubble for ``kind`` with each stage's passes taking their measured
    time (per micro-batch, median over steps)."""
    from hpctrain.parallel.pipeline import schedules as S

    def per_pass(key):
        return [statistics.median(s[key]) / m for s in stages]

    # A fused backward is backward_s alone (weight_s is 0): B, and W = 0.
    return S.predicted_bubble(kind, len(stages), m, times={
        "t_forward": per_pass("forward_s"), "t_backward": per_pass("backward_s"),
        "t_weight": per_pass("weight_s")})


def bubble_theory(p: int, m: int, virtual: int = 1) -> float:
    """Idle share of a stage with unit-time passes (Narayanan et al. 2021, eq. 1-2)."""
    return (p - 1) / (virtual * m + p - 1)


# --------------------------------------------------------------------------- workers

def _stage_setup(comm, p, m, virtual=1):
    import torch

    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.comm.world import World
    from hpctrain.model.gpt import GPT, GPTConfig
    from hpctrain.parallel.pipeline.stage import PipelineStage

    torch.set_num_threads(1)
    world = World.create(comm)
    grid = ProcessGrid.create(world, p)
    torch.manual_seed(0)
    stage = PipelineStage(GPT(GPTConfig(**MODEL)), grid.stage, p, virtual)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, MODEL["vocab_size"], (m * ROWS, MODEL["block_size"]), generator=gen)
    y = torch.randint(0, MODEL["vocab_size"], (m * ROWS, MODEL["block_size"]), generator=gen)
    return grid, stage, x, y


def _timed_steps(comm, steps, run_pipeline, after, compute, extra=None) -> dict:
    """WARMUP + steps steps from a common start; per timed step this stage's whole step,
    its pipeline phase and its compute seconds (``compute()``: a running total)."""
    rec = {"step_s": [], "pipe_s": [], "compute_s": []}
    for i in range(WARMUP + steps):
        comm.Barrier()
        c0 = compute()
        extra_before = extra.before() if extra else None
        t0 = time.perf_counter()
        run_pipeline()
        t1 = time.perf_counter()
        after()
        t2 = time.perf_counter()
        if i >= WARMUP:
            rec["step_s"].append(t2 - t0)
            rec["pipe_s"].append(t1 - t0)
            rec["compute_s"].append(compute() - c0)
            if extra:
                extra.after(rec, extra_before)
    return rec


def _ours(comm, p, m, kind, steps, probe_memory):
    """This stage's per-step times, receive waits and (optionally) peak activation bytes."""
    import torch

    from hpctrain.parallel.pipeline.executor import PipelineExecutor

    grid, stage, x, y = _stage_setup(comm, p, m, VIRTUAL if kind == "interleaved" else 1)
    opt = torch.optim.AdamW(list(stage.parameters()), lr=1e-4, fused=True)
    peak = [0]
    probe = (lambda: peak.__setitem__(0, max(peak[0], heap_in_use()))) if probe_memory \
        else None
    ex = PipelineExecutor(stage, grid, kind=kind, n_micro=m, seq=MODEL["block_size"],
                          timeout=120, memory_probe=probe)
    xs, ys = list(x.split(ROWS)), list(y.split(ROWS))

    passes = ("forward_s", "backward_s", "weight_s")

    class Extra:  # receive waits, seconds per kind of pass, the activation peak of each step
        @staticmethod
        def before():
            base = heap_in_use() if probe_memory else 0
            peak[0] = base
            return ex.stats.bubble_s, base, [getattr(ex.stats, k) for k in passes]

        @staticmethod
        def after(rec, before):
            rec.setdefault("bubble_s", []).append(ex.stats.bubble_s - before[0])
            for k, t0 in zip(passes, before[2]):
                rec.setdefault(k, []).append(getattr(ex.stats, k) - t0)
            if probe_memory:
                rec.setdefault("act_bytes", []).append(peak[0] - before[1])

    def step():
        opt.zero_grad(set_to_none=False)
        ex.train_step(xs, ys, 1.0 / m)

    def optimizer():
        opt.step()
        ex.tie_weights()

    return _timed_steps(comm, steps, step, optimizer, lambda: ex.stats.compute_s, Extra)


def _torch_pipelining(comm, p, m, kind, steps):
    """The same stages under torch.distributed.pipelining's schedule of the same kind."""
    import torch
    import torch.distributed.pipelining as pipelining
    import torch.nn.functional as F

    virtual = VIRTUAL if kind == "interleaved" else 1
    grid, stage, x, y = _stage_setup(comm, p, m, virtual)
    clock = {"compute_s": 0.0}

    class Chunk(torch.nn.Module):
        """One chunk of our stage, holding only its own parts (torch scales the grads of
        each stage module's parameters: a shared module would be scaled twice)."""

        def __init__(self, c):
            super().__init__()
            self.first, self.last = stage.is_first_chunk(c), stage.is_last_chunk(c)
            if self.first:
                self.wte, self.wpe, self.drop = stage.wte, stage.wpe, stage.drop
            self.layers = torch.nn.ModuleList(stage.h[str(i)] for i in stage.chunk_layers[c])
            if self.last:
                self.ln_f = stage.ln_f
                self.head_weight = torch.nn.Parameter(stage.head_weight.detach().clone())

        def forward(self, h):
            if self.first:
                h = self.drop(self.wte(h) + self.wpe(torch.arange(h.size(1))))
            for block in self.layers:
                h = block(h)
            if self.last:
                return F.linear(self.ln_f(h), self.head_weight)
            return h

    class TimedStage(pipelining.PipelineStage):
        """torch's stage with its forward and backward passes timed."""

        def forward_one_chunk(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super().forward_one_chunk(*args, **kwargs)
            finally:
                clock["compute_s"] += time.perf_counter() - t0

        def backward_one_chunk(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super().backward_one_chunk(*args, **kwargs)
            finally:
                clock["compute_s"] += time.perf_counter() - t0

        def backward_weight_one_chunk(self, *args, **kwargs):  # zero bubble's W
            t0 = time.perf_counter()
            try:
                return super().backward_weight_one_chunk(*args, **kwargs)
            finally:
                clock["compute_s"] += time.perf_counter() - t0

    def loss_fn(logits, target):  # our last chunk's loss, timed as forward compute
        t0 = time.perf_counter()
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))
        clock["compute_s"] += time.perf_counter() - t0
        return loss

    init_gloo(comm)
    chunks = [Chunk(c) for c in range(virtual)]
    opt = torch.optim.AdamW([q for c in chunks for q in c.parameters()], lr=1e-4, fused=True)
    # Chunk c of this rank is global stage c * p + rank (Megatron's and torch's layout).
    stages = [TimedStage(chunk, c * p + grid.stage, p * virtual, torch.device("cpu"))
              for c, chunk in enumerate(chunks)]
    cls = getattr(pipelining, TORCH_SCHEDULES[kind])
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], m, loss_fn=loss_fn)

    def step():
        opt.zero_grad(set_to_none=False)
        if stage.has_embedding:
            sched.step(x)
        elif stage.has_head:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    rec = _timed_steps(comm, steps, step, opt.step, lambda: clock["compute_s"])
    return rec


def worker(out: Path, args: list[str]) -> None:
    import json

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode, kind, m, steps = args[0], args[1], int(args[2]), int(args[3])
    p = comm.size
    if mode in ("ours", "ours-memory"):
        res = _ours(comm, p, m, kind, steps, probe_memory=mode == "ours-memory")
    else:
        res = _torch_pipelining(comm, p, m, kind, steps)
    everyone = comm.gather(res, root=0)
    if comm.rank == 0:
        out.write_text(json.dumps({"stages": everyone, **combine_stages(everyone)}))


# ---------------------------------------------------------------------------- driver

def part_bubble(micro: list[int], steps: int) -> tuple[list[dict], list[list], list[list]]:
    records, rows_a, rows_b = [], [], []
    for p in (2, 4):
        for m in micro:
            per = {}
            for kind in ("1f1b", "gpipe"):
                r = run_worker(p, __file__, ["ours-memory", kind, str(m), str(steps)])
                act = [max(s["act_bytes"]) for s in r["stages"]]
                per[kind] = {"per_step": {k: r[k] for k in ("step_s", "pipe_s",
                                                            "busiest_compute_s",
                                                            "efficiency", "bubble")},
                             "bubble_theory": bubble_theory(p, m), "act_bytes": act,
                             "act_bytes_max": max(act)}
                rows_a.append([p, m, kind, bubble_theory(p, m), fmt_spread(r["bubble"]),
                               fmt_spread(r["efficiency"]), fmt_spread(r["step_s"], 1e3)])
            ratio = per["1f1b"]["act_bytes_max"] / per["gpipe"]["act_bytes_max"]
            rows_b.append([p, m, per["1f1b"]["act_bytes_max"] / 2**20,
                           per["gpipe"]["act_bytes_max"] / 2**20, ratio, p / m,
                           "met" if ratio <= 1.1 * p / m else "MISSED"])
            records.append({"p": p, "m": m, **per, "act_ratio": ratio, "act_target": p / m})
    return records, rows_a, rows_b


def part_vs_torch(m: int, steps: int, rounds: int) -> list[dict]:
    records = []
    for p in (2, 4):
        runs = {kind: {"ours": [], "torch": []} for kind in TORCH_SCHEDULES}
        for _ in range(rounds):  # every job once per round, so drift hits all alike
            for kind in TORCH_SCHEDULES:
                for impl in ("ours", "torch"):
                    r = run_worker(p, __file__, [impl, kind, str(m), str(steps)],
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


def part_zero_bubble(steps: int, rounds: int) -> list[dict]:
    from hpctrain.parallel.pipeline import schedules as S

    records = []
    for m in ZB_MICRO:
        runs = {job: [] for job in ZB_JOBS}
        for _ in range(rounds):
            for impl, kind in ZB_JOBS:
                runs[(impl, kind)].append(run_worker(ZB_P, __file__, [impl, kind, str(m),
                                                                     str(steps)],
                                                     retries=1 if impl == "torch" else 0))
        rec = {"p": ZB_P, "m": m}
        for (impl, kind), rs in runs.items():
            rec[f"{impl} {kind}"] = {k: [statistics.median(r[k]) for r in rs]
                                     for k in ("step_s", "efficiency")}
        ours = rec["ours zb-h1"]["step_s"]
        rec["speedup"] = {name: [t / o for t, o in zip(rec[name]["step_s"], ours)]
                          for name in ZB_TARGETS}
        for kind in ("zb-h1", "1f1b"):
            rs = runs[("ours", kind)]
            rec[f"bubble {kind}"] = {
                "measured": [statistics.median(measured_idle(r["stages"], i)
                                               for i in range(len(r["step_s"]))) for r in rs],
                "predicted": [predicted_idle(kind, r["stages"], m) for r in rs],
                "predicted_unit": S.predicted_bubble(kind, ZB_P, m)}
        records.append(rec)
        print(f"  p={ZB_P} m={m}: zb-h1 {fmt_spread(ours, 1e3)} ms, torch 1F1B "
              f"{fmt_spread(rec['torch 1f1b']['step_s'], 1e3)} ms", flush=True)
    return records


def zero_bubble_rows(records: list[dict]) -> tuple[list[list], list[list]]:
    speed, bubble = [], []
    for r in records:
        for name, target in ZB_TARGETS.items():
            ratio = statistics.median(r["speedup"][name])
            verdict = "-" if target is None else ("met" if ratio >= target else "MISSED")
            speed.append([r["p"], r["m"], name, fmt_spread(r["ours zb-h1"]["step_s"], 1e3),
                          fmt_spread(r[name]["step_s"], 1e3), fmt_spread(r["speedup"][name]),
                          "-" if target is None else f"{fmt(target)}x {verdict}"])
        for kind in ("zb-h1", "1f1b"):
            b = r[f"bubble {kind}"]
            bubble.append([r["p"], r["m"], kind, fmt_spread(b["measured"]),
                           fmt_spread(b["predicted"]), fmt(b["predicted_unit"])])
    return speed, bubble


ZB_SPEED_COLUMNS = ["p", "m", "against", "zb-h1 ms", "their ms", "speedup", "target"]
ZB_BUBBLE_COLUMNS = ["p", "m", "schedule", "measured idle", "predicted (measured passes)",
                     "predicted (unit passes)"]


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
    print(f"\nD. zero bubble (p = {ZB_P}, m = {list(ZB_MICRO)}, {rounds} round(s))", flush=True)
    zero_bubble = part_zero_bubble(steps, rounds)
    speed, idle = zero_bubble_rows(zero_bubble)
    print_table("D. our zb-h1 vs torch's 1F1B, torch's zero bubble and our 1F1B: step ms "
                "(optimizer included), median [min, max] over rounds; speedup = theirs / "
                "ours per round", ZB_SPEED_COLUMNS, speed)
    print_table("D. bubble: idle share of all stages, measured vs the simulator's "
                "prediction; median [min, max] over rounds", ZB_BUBBLE_COLUMNS, idle)
    zb_met = all(statistics.median(r["speedup"][name]) >= target for r in zero_bubble
                 for name, target in ZB_TARGETS.items() if target is not None)
    write_result("pipeline", {"quick": args.quick, "model": MODEL, "rows_per_micro": ROWS,
                              "steps": steps, "warmup": WARMUP, "rounds": rounds,
                              "virtual": VIRTUAL, "bubble": bubble, "vs_torch": vs_torch,
                              "target_vs_torch": TARGET_VS_TORCH,
                              "met": worst >= TARGET_VS_TORCH, "zero_bubble": zero_bubble,
                              "zero_bubble_targets": ZB_TARGETS,
                              "zero_bubble_met": zb_met}, smoke=args.quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        worker(out, rest)
    else:
        main(rest)
