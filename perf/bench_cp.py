"""Context parallelism (``--parallel.cp``): the longest sequence a rank trains under a
fixed memory cap at cp = 1, 2, 4; ring attention's step time against the plain
alternative; and the share of the ring's transfers hidden behind attention compute.

The model is Llama-shaped and small enough for a CPU (2 layers, width 128, 4 query and
2 key/value heads, SwiGLU of hidden width 384, a 4,096-token vocabulary, untied head),
fp32, one sequence per step, the ranks of one context-parallel group on this machine
(each rank one thread). Each worker builds the model as ``parallelize`` does for cp > 1
(``context_parallelize``: ring attention over MPI, global positions), feeds each rank
its two chunks of the same random sequence, and runs forward and backward (no optimizer
step, no gradient reduction: both are the same with and without cp).

  A. Memory: the longest sequence (a multiple of SEARCH_STEP tokens, up to MAX_T) whose
     training step stays under a cap on every rank: the cap is cp = 1's peak at CAP_T
     tokens, in the same run. Peak: each rank's peak resident-set growth over a step
     (``/proc/self/clear_refs`` resets the mark after a warm-up step; glibc maps every
     block over 1 MiB on its own, so freed tensors leave at once; as
     ``bench_long_context.py``), the largest over the ranks. The warm-up step has
     WARMUP_T tokens per rank at every cp: blocks under 1 MiB stay in glibc's heap once
     freed, and the measured step reuses them without growing the RSS, so a warm-up of
     WARMUP_T tokens in all would leave cp = 1 cp times the reusable heap of a cp rank
     and count that difference against cp. Variants: plain at cp = 1,
     2, 4 (goal: >= 0.9 cp x cp = 1's), and cp = 4 with block recomputation and the
     chunked loss (goal: >= 8x cp = 1's plain).
  B. Speed: step time (median [min, max] over REPEATS steps after a warm-up) of ring
     attention at cp = 2 and 4 against the plain alternative on the same ranks, model
     and batches: every rank all-gathers the keys and values of the whole sequence
     (torch.distributed over gloo, the gradients all-reduced back in backward) and runs
     torch's scaled_dot_product_attention of its queries on them with the causal mask
     of its positions. torch's own context parallelism
     (``torch.distributed.tensor.experimental.context_parallel``) dispatches only the
     CUDA attention kernels (flash, efficient, cuDNN), so it does not run on this
     machine's CPU backend. Goal: ring >= 1.2x faster.
  C. Overlap: in B's ring steps, the share of the ring's transfers (all of one size
     within a pass) already complete when the compute posted beside them ended
     (``MPI.Request.Testall`` just before the wait): hidden behind attention. Beside
     it, the time the ranks spent blocked in waits (which includes waiting for a
     slower neighbour's compute, not only transfers) and the time the same transfers
     take back to back with nothing between post and wait (the ring's communication
     alone, same process, same block sizes).

The machine has 2 cores shared by the ranks (cp = 4 oversubscribes it); memory is the
result, times are indications for this machine only.

    python perf/bench_cp.py [--quick]
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (bench_parser, fmt, fmt_spread, init_gloo,  # noqa: E402
                         print_table, run_worker, worker_args, write_result)
from hpctrain.sizes import MiB  # noqa: E402

MODEL = dict(arch="llama", vocab_size=4096, n_layer=2, n_embd=128, n_head=4, n_kv_head=2,
             ffn_hidden=384, tie_embeddings=False)
LOSS_CHUNK = 512
VARIANTS = {  # name -> (cp, GPTConfig options)
    "cp1": (1, {}),
    "cp2": (2, {}),
    "cp4": (4, {}),
    "cp4+recompute+chunked": (4, {"recompute": "block", "loss_chunk": LOSS_CHUNK}),
}
CAP_T, SEARCH_STEP, MAX_T = 1024, 128, 8192
WARMUP_T = 256
SPEED_T, REPEATS = 4096, 5
GOAL_MEMORY, GOAL_COMBINED, GOAL_SPEED = 0.9, 8.0, 1.2
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
QUICK = dict(cap_t=512, max_t=2048, speed_t=1024, repeats=2)


# --------------------------------------------------------------------------- worker

def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not in /proc/self/status")


class _TimedRing:
    """A ``Ring`` whose transfers record, at their wait (the block's compute done),
    whether they had completed already (``MPI.Request.Testall``: hidden behind the
    compute) and how long the wait blocked."""

    def __init__(self, ring):
        self.ring, self.waits, self.done_at_wait = ring, [], []

    def __getattr__(self, name):
        return getattr(self.ring, name)

    def shift(self, t, direction, tag, what):
        from mpi4py import MPI

        transfer = self.ring.shift(t, direction, tag, what)
        wait, requests = transfer.wait, transfer._requests

        def timed():
            self.done_at_wait.append(bool(MPI.Request.Testall(requests)))
            t0 = time.perf_counter()
            out = wait()
            self.waits.append(time.perf_counter() - t0)
            return out
        transfer.wait = timed
        return transfer


class _AllGatherKV:
    """The plain alternative: every rank gathers the whole sequence's keys and values
    (torch.distributed, gloo) and attends its queries to them under its causal mask."""

    def __init__(self, rank: int, cp: int):
        self.rank, self.cp = rank, cp

    def __call__(self, q, k, v):
        import torch
        import torch.nn.functional as F

        from hpctrain.parallel.context import chunks

        L = q.size(-2)
        T = L * self.cp
        k_all, v_all = _Gather.apply(k, self.cp), _Gather.apply(v, self.cp)
        key_pos = torch.cat([chunks.positions(r, self.cp, T) for r in range(self.cp)])
        q_pos = chunks.positions(self.rank, self.cp, T)
        mask = key_pos[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                              enable_gqa=k.size(1) != q.size(1))


def _gather_fn():
    import torch
    import torch.distributed as dist

    class Gather(torch.autograd.Function):
        """All-gather along the tokens in rank order; backward all-reduces the gathered
        gradient and keeps this rank's part (gloo has no reduce-scatter)."""

        @staticmethod
        def forward(ctx, t, cp):
            parts = [torch.empty_like(t) for _ in range(cp)]
            dist.all_gather(parts, t.contiguous())
            ctx.cp, ctx.L = cp, t.size(-2)
            return torch.cat(parts, dim=-2)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad)
            r = dist.get_rank()
            return grad.narrow(-2, r * ctx.L, ctx.L).contiguous(), None
    return Gather


_Gather = None


def _model(variant: str, T: int):
    import torch

    from hpctrain.model.gpt import GPT, GPTConfig

    cp, options = VARIANTS[variant]
    torch.manual_seed(0)
    return cp, GPT(GPTConfig(block_size=max(T, WARMUP_T * cp), **MODEL, **options))


def _batch(T: int, rank: int, cp: int, seed: int):
    import torch

    from hpctrain.parallel.context import chunks

    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, MODEL["vocab_size"], (2, 1, T), generator=gen)
    return chunks.split_sequence(x, rank, cp), chunks.split_sequence(y, rank, cp)


def worker_memory(out: Path, variant: str, T: int) -> None:
    import torch
    from mpi4py import MPI

    from hpctrain.parallel.context.apply import context_parallelize
    from hpctrain.parallel.context.ring import MPIRing

    comm = MPI.COMM_WORLD
    cp, model = _model(variant, T)
    assert comm.size == cp, f"{variant} runs on {cp} ranks, not {comm.size}"
    context_parallelize(model, MPIRing(comm))

    def step(t: int) -> None:
        x, y = _batch(t, comm.rank, cp, seed=1)
        model(x, y).backward()
        model.zero_grad(set_to_none=False)  # the buffers stay: they are not activations

    step(WARMUP_T * cp)  # WARMUP_T tokens per rank whatever cp (see the docstring)
    comm.Barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark := the RSS now
    base = _rss_bytes()
    step(T)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    peaks = comm.gather(peak, root=0)
    if comm.rank == 0:
        out.write_text(json.dumps({"variant": variant, "seq": T, "peak_bytes": max(peaks),
                                   "peak_by_rank": peaks,
                                   "params": sum(p.numel() for p in model.parameters())}))
    del torch


def worker_speed(out: Path, cp: int, T: int, repeats: int) -> None:
    import torch
    from mpi4py import MPI

    from hpctrain.parallel.context.apply import RingContext, context_parallelize
    from hpctrain.parallel.context.ring import MPIRing

    global _Gather
    comm = MPI.COMM_WORLD
    init_gloo(comm)
    _Gather = _gather_fn()
    _, model = _model(f"cp{cp}", T)
    ring = _TimedRing(MPIRing(comm))
    context_parallelize(model, ring)
    attns = [m for m in model.modules() if isinstance(getattr(m, "context", None), RingContext)]
    ring_ctx, gather_ctx = attns[0].context, _AllGatherKV(comm.rank, cp)
    x, y = _batch(T, comm.rank, cp, seed=2)

    def step() -> float:
        comm.Barrier()
        t0 = time.perf_counter()
        model(x, y).backward()
        model.zero_grad(set_to_none=False)
        took = time.perf_counter() - t0
        return max(comm.allgather(took))  # the group's step: its slowest rank

    times: dict[str, list[float]] = {"ring": [], "allgather": []}
    exposed, hidden = [], []
    for i in range(repeats + 1):  # the first of each is a warm-up
        for name, ctx in (("ring", ring_ctx), ("allgather", gather_ctx)):
            for m in attns:
                m.context = ctx
            ring.waits.clear()
            ring.done_at_wait.clear()
            took = step()
            if i:
                times[name].append(took)
                if name == "ring":
                    exposed.append(sum(ring.waits))
                    hidden.append(sum(ring.done_at_wait) / max(1, len(ring.done_at_wait)))
    # The same transfers with nothing between post and wait: the ring alone.
    alone = []
    q_like = torch.randn(2, 1, MODEL["n_kv_head"], T // cp, MODEL["n_embd"] // MODEL["n_head"])
    n_fwd, n_bwd = MODEL["n_layer"] * (cp - 1), 2 * MODEL["n_layer"] * (cp - 1)
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(n_fwd):
            ring.ring.shift(q_like, +1, 1, "alone").wait()
        for _ in range(n_bwd):  # backward: the block and its fp32 gradient
            ring.ring.shift(q_like, -1, 2, "alone").wait()
        alone.append(time.perf_counter() - t0)
    hidden_all = comm.gather(hidden, root=0)
    exposed_all = comm.gather(exposed, root=0)
    alone_all = comm.gather(alone, root=0)
    if comm.rank == 0:
        per_step_exposed = [max(r[i] for r in exposed_all) for i in range(repeats)]
        per_step_alone = [max(r[i] for r in alone_all) for i in range(repeats)]
        hidden_share = [statistics.mean(r[i] for r in hidden_all) for i in range(repeats)]
        out.write_text(json.dumps({"cp": cp, "seq": T, "step_s": times,
                                   "exposed_s": per_step_exposed, "alone_s": per_step_alone,
                                   "hidden_share": hidden_share}))
    torch.distributed.destroy_process_group()


def measure_memory(variant: str, T: int) -> dict:
    cp = VARIANTS[variant][0]
    return run_worker(cp, __file__, ["memory", variant, str(T)], env=MALLOC_ENV,
                      timeout=1800)


# --------------------------------------------------------------------------- driver

def longest_under(fits, start: int, max_t: int, step: int) -> int:
    """The largest multiple of ``step`` up to ``max_t`` for which ``fits`` holds: doubling
    from ``start``, then bisection (as ``bench_long_context.py``)."""
    lo, hi = 0, start
    while fits(hi):
        lo = hi
        if hi == max_t:
            return lo
        hi = min(2 * hi, max_t)
    while hi - lo > step:
        mid = lo + (hi - lo) // step // 2 * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def part_memory(cap_t: int, max_t: int) -> dict:
    base = measure_memory("cp1", cap_t)
    cap = base["peak_bytes"]
    print(f"  cap: cp1's peak at {cap_t} tokens = {cap / MiB:.1f} MiB", flush=True)
    found = {}
    for variant, (cp, _) in VARIANTS.items():
        known = {cap_t: base["peak_bytes"]} if variant == "cp1" else {}

        def fits(T: int) -> bool:
            if T not in known:
                known[T] = measure_memory(variant, T)["peak_bytes"]
                print(f"  {variant:<22} T={T:>6}: peak {known[T] / MiB:8.1f} MiB -> "
                      f"{'fits' if known[T] <= cap else 'too big'}", flush=True)
            return known[T] <= cap

        longest = longest_under(fits, cap_t, max_t, SEARCH_STEP)
        found[variant] = {"cp": cp, "longest": longest, "at_limit": longest == max_t,
                          "probes": {str(k): v for k, v in sorted(known.items())}}
    plain = found["cp1"]["longest"]
    for f in found.values():
        f["vs_cp1"] = f["longest"] / plain if plain else None
    return {"cap_bytes": cap, "cap_t": cap_t, "search_step": SEARCH_STEP, "max_t": max_t,
            "by_variant": found}


def part_speed(T: int, repeats: int) -> dict:
    rows = {}
    for cp in (2, 4):
        r = run_worker(cp, __file__, ["speed", str(cp), str(T), str(repeats)], timeout=3600)
        ring, gather = r["step_s"]["ring"], r["step_s"]["allgather"]
        r["speedup"] = statistics.median(gather) / statistics.median(ring)
        rows[str(cp)] = r
        print(f"  cp={cp}: ring {fmt_spread(ring, 1e3)} ms, all-gather "
              f"{fmt_spread(gather, 1e3)} ms -> {fmt(r['speedup'])}x; hidden share "
              f"{fmt_spread(r['hidden_share'])}; blocked {fmt_spread(r['exposed_s'], 1e3)} "
              f"ms, transfers alone {fmt_spread(r['alone_s'], 1e3)} ms", flush=True)
    return rows


def main(argv: list[str]) -> None:
    args = bench_parser(__doc__).parse_args(argv)
    quick = args.quick
    cap_t = QUICK["cap_t"] if quick else CAP_T
    max_t = QUICK["max_t"] if quick else MAX_T
    speed_t = QUICK["speed_t"] if quick else SPEED_T
    repeats = QUICK["repeats"] if quick else REPEATS
    print(f"A. longest sequence under cp=1's peak at {cap_t} tokens, steps of {SEARCH_STEP} "
          f"up to {max_t}", flush=True)
    memory = part_memory(cap_t, max_t)
    by = memory["by_variant"]
    print_table("Longest sequence under the same per-rank memory cap",
                ["variant", "cp", "longest T", "vs cp=1", "goal"],
                [[v, f["cp"], f["longest"] if not f["at_limit"] else f">= {f['longest']}",
                  f["vs_cp1"], GOAL_COMBINED if "+" in v else GOAL_MEMORY * f["cp"]]
                 for v, f in by.items()])
    print(f"\nB/C. step time at T = {speed_t}, ring against all-gathered keys and values",
          flush=True)
    speed = part_speed(speed_t, repeats)
    print_table("Step time (ms, median [min, max]) and the ring's hidden communication",
                ["cp", "ring ms", "all-gather ms", "speedup", "blocked ms", "alone ms",
                 "hidden share"],
                [[cp, fmt_spread(r["step_s"]["ring"], 1e3),
                  fmt_spread(r["step_s"]["allgather"], 1e3), r["speedup"],
                  fmt_spread(r["exposed_s"], 1e3), fmt_spread(r["alone_s"], 1e3),
                  fmt_spread(r["hidden_share"])]
                 for cp, r in speed.items()])
    goals = {
        "memory_cp2": (by["cp2"]["vs_cp1"] or 0) >= GOAL_MEMORY * 2,
        "memory_cp4": (by["cp4"]["vs_cp1"] or 0) >= GOAL_MEMORY * 4,
        "memory_cp4_combined": (by["cp4+recompute+chunked"]["vs_cp1"] or 0) >= GOAL_COMBINED,
        "speed_cp2": speed["2"]["speedup"] >= GOAL_SPEED,
        "speed_cp4": speed["4"]["speedup"] >= GOAL_SPEED}
    for name, met in goals.items():
        print(f"goal {name}: {'MET' if met else 'NOT MET'}")
    write_result("cp", {
        "quick": quick, "model": MODEL, "loss_chunk": LOSS_CHUNK, "dtype": "fp32", "rows": 1,
        "threads_per_rank": 1, "memory": memory, "speed_seq": speed_t, "repeats": repeats,
        "speed": speed, "goals": {"memory_ratio": GOAL_MEMORY, "combined": GOAL_COMBINED,
                                  "speedup": GOAL_SPEED, "met": goals}}, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker and rest[0] == "memory":
        worker_memory(out, rest[1], int(rest[2]))
    elif is_worker:
        worker_speed(out, int(rest[1]), int(rest[2]), int(rest[3]))
    else:
        main(rest)
