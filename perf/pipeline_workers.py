"""The pipeline benchmarks' workers and bookkeeping: one stage of an 8-layer GPT run
under one of our schedules (``PipelineExecutor``) or under torch.distributed.pipelining's
schedule of the same kind, with the same stage modules, micro-batches, loss and fused
AdamW step; per step, the stage's whole step, its pipeline phase (without the optimizer)
and the seconds of its compute passes. ``perf/bench_pipeline.py`` and
``perf/bench_zero_bubble.py`` start it under mpiexec (``run_worker``):

    pipeline_workers.py --worker --out FILE ours|ours-memory|torch KIND M STEPS [F,B,W]
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import init_gloo, worker_args  # noqa: E402

MODEL = dict(vocab_size=96, block_size=128, n_layer=8, n_head=8, n_embd=256)
ROWS = 2  # per micro-batch
WARMUP, STEPS, ROUNDS = 2, 5, 3
VIRTUAL = 2  # chunks per stage of the interleaved schedule
TORCH_SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "gpipe": "ScheduleGPipe", "zb-h1": "ScheduleInterleavedZeroBubble",
                   "zbv": "ScheduleZBVZeroBubble"}
"""torch.distributed.pipelining's schedule of the same kind as each of ours (zb-h1:
torch's interleaved zero bubble with one stage per rank, which is ZB-H1)."""


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


def predicted_idle(kind: str, stages: list[dict], m: int, order_times: str = "") -> float:
    """The simulator's bubble for ``kind`` with each stage's passes taking their measured
    time (per micro-batch, median over steps); the order built for ``order_times``
    (``--parallel.pass_times``; empty: equal)."""
    from hpctrain.parallel.pipeline import schedules as S

    def per_pass(key):  # one chunk's pass of one micro-batch (zbv: the stage's mean)
        return [statistics.median(s[key]) / (m * chunks_of(kind)) for s in stages]

    # A fused backward is backward_s alone (weight_s is 0): B, and W = 0.
    times = {"t_forward": per_pass("forward_s"), "t_backward": per_pass("backward_s"),
             "t_weight": per_pass("weight_s")}
    return S.predicted_bubble(kind, len(stages), m, times=times,
                              order_times=parse_order_times(order_times))


def bubble_theory(p: int, m: int, virtual: int = 1) -> float:
    """Idle share of a stage with unit-time passes (Narayanan et al. 2021, eq. 1-2)."""
    return (p - 1) / (virtual * m + p - 1)


# --------------------------------------------------------------------------- workers

def chunks_of(kind: str) -> int:
    """Model chunks per stage: 2 for interleaved (``VIRTUAL``) and zbv (its V), else 1."""
    from hpctrain.parallel.pipeline import schedules as S

    return S.chunks_per_stage(kind, VIRTUAL if kind == "interleaved" else 1)


def _stage_setup(comm, p, m, kind):
    import torch

    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.comm.world import World
    from hpctrain.model.gpt import GPT, GPTConfig
    from hpctrain.parallel.pipeline import schedules as S
    from hpctrain.parallel.pipeline.stage import PipelineStage

    torch.set_num_threads(1)
    world = World.create(comm)
    grid = ProcessGrid.create(world, p)
    torch.manual_seed(0)
    stage = PipelineStage(GPT(GPTConfig(**MODEL)), grid.stage, p, chunks_of(kind),
                          v_shape=kind in S.V_PLACED)
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


def parse_order_times(text: str):
    """``--parallel.pass_times`` text -> PassTimes (empty: equal times)."""
    from hpctrain.parallel.pipeline.pass_times import EQUAL, PassTimes

    return PassTimes(*map(float, text.split(","))) if text else EQUAL


def measured_pass_times(stages: list[dict]) -> str:
    """``--parallel.pass_times`` from a run of ours: F, B, W seconds of the stages after
    the first (whose first chunk has no B), relative to F."""
    from hpctrain.parallel.pipeline import pass_times

    totals = [sum(sum(s[k]) for s in stages[1:]) for k in ("forward_s", "backward_s",
                                                          "weight_s")]
    return pass_times.text(pass_times.measured(*totals))


def _ours(comm, p, m, kind, steps, probe_memory, order_times=""):
    """This stage's per-step times, receive waits and (optionally) peak activation bytes.
    ``order_times``: ``--parallel.pass_times`` for a zero-bubble order."""
    import torch

    from hpctrain.parallel.pipeline.executor import PipelineExecutor

    grid, stage, x, y = _stage_setup(comm, p, m, kind)
    opt = torch.optim.AdamW(list(stage.parameters()), lr=1e-4, fused=True)
    peak = [0]
    probe = (lambda: peak.__setitem__(0, max(peak[0], heap_in_use()))) if probe_memory \
        else None
    ex = PipelineExecutor(stage, grid, kind=kind, n_micro=m, seq=MODEL["block_size"],
                          timeout=120, memory_probe=probe,
                          order_times=parse_order_times(order_times))
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

    from hpctrain.parallel.pipeline import schedules as S

    virtual = chunks_of(kind)
    grid, stage, x, y = _stage_setup(comm, p, m, kind)
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

    def timed(method):
        """``method`` of torch's stage, its seconds added to the compute clock."""
        def run(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return getattr(pipelining.PipelineStage, method)(self, *args, **kwargs)
            finally:
                clock["compute_s"] += time.perf_counter() - t0
        return run

    # torch's stage with its forward, backward and (zero bubble) W passes timed.
    TimedStage = type("TimedStage", (pipelining.PipelineStage,), {
        m: timed(m) for m in ("forward_one_chunk", "backward_one_chunk",
                              "backward_weight_one_chunk")})

    def loss_fn(logits, target):  # our last chunk's loss, timed as forward compute
        t0 = time.perf_counter()
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), target.view(-1))
        clock["compute_s"] += time.perf_counter() - t0
        return loss

    init_gloo(comm)
    chunks = [Chunk(c) for c in range(virtual)]
    opt = torch.optim.AdamW([q for c in chunks for q in c.parameters()], lr=1e-4, fused=True)
    # Chunk c of this rank is the same global stage in both: c * p + rank (Megatron's and
    # torch's layout), or in a V (zbv) rank for c = 0 and 2p - 1 - rank for c = 1.
    stages = [TimedStage(chunk, S.global_chunk(kind, grid.stage, c, p), p * virtual,
                         torch.device("cpu"))
              for c, chunk in enumerate(chunks)]
    cls = getattr(pipelining, TORCH_SCHEDULES[kind])
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], m, loss_fn=loss_fn)

    def step():
        opt.zero_grad(set_to_none=False)
        if stage.has_embedding and stage.has_head:  # zbv's stage 0 holds both ends
            sched.step(x, target=y, losses=[])
        elif stage.has_embedding:
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
        res = _ours(comm, p, m, kind, steps, probe_memory=mode == "ours-memory",
                    order_times=args[4] if len(args) > 4 else "")
    else:
        res = _torch_pipelining(comm, p, m, kind, steps)
    everyone = comm.gather(res, root=0)
    if comm.rank == 0:
        out.write_text(json.dumps({"stages": everyone, **combine_stages(everyone)}))


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if not is_worker:
        sys.exit(__doc__)
    worker(out, rest)
