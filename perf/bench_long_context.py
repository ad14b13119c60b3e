"""Long context: peak memory and step time of one training step with the plain head,
the chunked head (``--model.loss_chunk``) and the chunked head with block recomputation
(``--model.recompute=block``), and the longest sequence each trains under a memory cap.

The model is Llama-shaped and small enough for a CPU (2 layers, width 256, 4 query and
2 key/value heads, SwiGLU of hidden width 768, an untied head, a 32,000-token
vocabulary: 18.0M parameters, 16.4M of them in the embedding and the head), fp32, one
sequence per step, THREADS threads. At this shape the head outweighs the blocks: per
token the plain head keeps 125 KiB of fp32 log-probabilities for backward, and backward
makes tensors of that size for their gradients; the chunked head keeps 4 bytes (a
log-sum-exp) and holds one chunk's logits at a time.

  A. For T = 1K, 2K, 4K and 16K tokens, each variant: the peak memory growth of a
     training step (forward and backward) and its time (median [min, max] over REPEATS
     steps; a single step from LONG_T tokens on, minutes of CPU each). Anchor: the
     plain head at the same T, in the same run.
  B. The longest sequence (a multiple of SEARCH_STEP tokens, up to MAX_T) whose step
     stays under a cap: by default the plain head's peak at CAP_T tokens, measured in
     A; ``--cap-mb`` sets another. Doubling from SEARCH_STEP, then bisection; one step
     per probe, A's measurements reused. Target: the chunked head trains >= 2x the
     plain head's context under the same cap.

Peak memory: each (variant, T) runs in a fresh process, so nothing of an earlier
configuration lingers in its heap. The process builds the model and trains one step at
WARMUP_T tokens first (torch loads kernels lazily, and the gradient buffers are made
once and zeroed in place afterwards), then resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``, which ``getrusage``'s ``ru_maxrss`` reads too), reads its
resident size, trains, and reports the peak minus that size. glibc is told to map every
block over 1 MiB on its own (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the
resident set at once instead of staying in the heap: the peak is that of the live
tensors, to a page. torch keeps no peak statistic for CPU memory
(``torch.cuda.max_memory_allocated`` has no CPU counterpart, and the profiler's memory
events are per operator), so the kernel's count of resident pages is the dependable one.

The machine is shared and its speed drifts: the memory figures are the result, the
step times a secondary indication (each process also maps its large tensors afresh,
which the default allocator would not).

    python perf/bench_long_context.py [--quick] [--cap-mb MB]
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import (bench_parser, fmt, fmt_spread, print_table,  # noqa: E402
                         run_worker, worker_args, write_result)
from hpctrain.sizes import MiB  # noqa: E402

MODEL = dict(arch="llama", vocab_size=32000, n_layer=2, n_embd=256, n_head=4, n_kv_head=2,
             tie_embeddings=False)
LOSS_CHUNK = 1024
VARIANTS = {  # name -> GPTConfig options
    "plain": {"loss_chunk": -1},  # the whole head, also where the default would chunk
    "chunked": {"loss_chunk": LOSS_CHUNK},
    "chunked+recompute": {"loss_chunk": LOSS_CHUNK, "recompute": "block"},
}
SEQ_LENS = (1024, 2048, 4096, 16384)
REPEATS, LONG_T = 3, 8192  # steps per configuration; a single one from LONG_T tokens on
THREADS = 2
WARMUP_T = 256
# The cap of part B: the plain head's peak at 2K tokens. At a larger cap the chunked
# variants' longest sequences take minutes per step on this CPU (attention grows as T^2),
# and the search stops at A's longest sequence for the same reason.
CAP_T = 2048
SEARCH_STEP = 512
MAX_T = 16384
TARGET = 2.0
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
QUICK = dict(seq_lens=(512, 1024), repeats=1, cap_t=1024, max_t=4096)


def repeats_at(seq: int, quick: bool) -> int:
    return 1 if quick or seq >= LONG_T else REPEATS


# --------------------------------------------------------------------------- worker

def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not in /proc/self/status")


def worker(out: Path, variant: str, seq: int, steps: int) -> None:
    """Train ``steps`` steps of one sequence of ``seq`` tokens; write the peak memory
    growth over the model, its gradients and a short step, and the step times."""
    import torch

    from hpctrain.model.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(block_size=max(seq, WARMUP_T), **MODEL, **VARIANTS[variant])
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(1)

    def step(t: int) -> float:
        x, y = torch.randint(0, cfg.vocab_size, (2, 1, t), generator=gen)
        t0 = time.perf_counter()
        model(x, y).backward()
        took = time.perf_counter() - t0
        model.zero_grad(set_to_none=False)  # the buffers stay: they are not activations
        return took

    step(WARMUP_T)
    Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark := the RSS now
    base = _rss_bytes()
    times = [step(seq) for _ in range(steps)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out.write_text(json.dumps({
        "variant": variant, "seq": seq, "peak_bytes": peak - base, "base_rss_bytes": base,
        "step_ms_all": [1e3 * t for t in times],
        "params": sum(p.numel() for p in model.parameters())}))


def measure(variant: str, seq: int, steps: int) -> dict:
    return run_worker(1, __file__, [variant, str(seq), str(steps)], mpi=False,
                      threads=THREADS, env=MALLOC_ENV, timeout=1800)


# --------------------------------------------------------------------------- driver

def part_sweep(seq_lens, quick: bool) -> list[dict]:
    records = []
    for seq in seq_lens:
        plain = None
        for variant in VARIANTS:
            r = measure(variant, seq, repeats_at(seq, quick))
            plain = plain or r
            r["vs_plain_peak"] = plain["peak_bytes"] / r["peak_bytes"]
            r["vs_plain_time"] = (statistics.median(r["step_ms_all"]) /
                                  statistics.median(plain["step_ms_all"]))
            records.append(r)
            print(f"  T={seq:>6} {variant:<18} peak {r['peak_bytes'] / MiB:8.1f} MiB, "
                  f"step {fmt_spread(r['step_ms_all'])} ms", flush=True)
    return records


def longest_under(fits, start: int, max_t: int, step: int = SEARCH_STEP) -> int:
    """The largest multiple of ``step`` up to ``max_t`` for which ``fits(seq)`` holds (0
    if none does), for a ``fits`` that holds up to some length and not beyond: doubling
    from ``start`` (a multiple of ``step``), then bisection."""
    lo, hi = 0, start  # lo fits (0: nothing yet); hi is the next to try
    while fits(hi):
        lo = hi
        if hi == max_t:
            return lo
        hi = min(2 * hi, max_t)
    while hi - lo > step:  # lo fits, hi does not
        mid = lo + (hi - lo) // step // 2 * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def part_capacity(sweep: list[dict], cap: float, max_t: int) -> dict:
    """Per variant, the longest sequence under ``cap`` bytes, probing from the shortest
    sequence of the sweep and reusing its peaks."""
    found = {}
    for variant in VARIANTS:
        known = {r["seq"]: r["peak_bytes"] for r in sweep if r["variant"] == variant}

        def fits(seq: int) -> bool:
            if seq not in known:
                known[seq] = measure(variant, seq, 1)["peak_bytes"]
                print(f"  {variant:<18} T={seq:>6}: peak {known[seq] / MiB:8.1f} MiB -> "
                      f"{'fits' if known[seq] <= cap else 'too big'}", flush=True)
            return known[seq] <= cap

        longest = longest_under(fits, min(known, default=SEARCH_STEP), max_t)
        found[variant] = {"longest": longest, "at_limit": longest == max_t,
                          "probes": {str(k): v for k, v in sorted(known.items())}}
        note = " (the search's limit)" if longest == max_t else ""
        print(f"  {variant}: longest {longest} tokens{note}", flush=True)
    plain = found["plain"]["longest"]
    for f in found.values():
        f["vs_plain"] = f["longest"] / plain if plain else None
    return found


def main(argv: list[str]) -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--cap-mb", type=float, default=None, metavar="MB",
                    help="memory cap for part B in MiB (default: the plain head's peak at "
                         f"{CAP_T} tokens, {QUICK['cap_t']} with --quick)")
    args = ap.parse_args(argv)
    quick = args.quick
    seq_lens = QUICK["seq_lens"] if quick else SEQ_LENS
    cap_t = QUICK["cap_t"] if quick else CAP_T
    max_t = QUICK["max_t"] if quick else MAX_T
    if cap_t not in seq_lens and args.cap_mb is None:
        seq_lens = tuple(sorted({*seq_lens, cap_t}))
    print(f"A. peak memory and step time, {MODEL['n_layer']} layers, width "
          f"{MODEL['n_embd']}, vocabulary {MODEL['vocab_size']}, loss_chunk {LOSS_CHUNK}, "
          f"fp32, 1 sequence, {THREADS} threads", flush=True)
    sweep = part_sweep(seq_lens, quick)
    print_table("Peak memory growth of a training step (MiB) and step time (ms, median "
                "[min, max]); ratios against the plain head at the same T",
                ["T", "variant", "peak MiB", "plain/this peak", "step ms", "this/plain time"],
                [[r["seq"], r["variant"], r["peak_bytes"] / MiB, r["vs_plain_peak"],
                  fmt_spread(r["step_ms_all"]), r["vs_plain_time"]] for r in sweep])
    if args.cap_mb is not None:
        cap, cap_from = args.cap_mb * MiB, "--cap-mb"
    else:
        cap = next(r["peak_bytes"] for r in sweep
                   if r["variant"] == "plain" and r["seq"] == cap_t)
        cap_from = f"the plain head's peak at {cap_t} tokens"
    print(f"\nB. longest sequence under {cap / MiB:.1f} MiB ({cap_from}), steps of "
          f"{SEARCH_STEP} up to {max_t}", flush=True)
    capacity = part_capacity(sweep, cap, max_t)
    print_table("Longest sequence under the cap",
                ["variant", "longest T", "vs plain"],
                [[v, f["longest"] if not f["at_limit"] else f">= {f['longest']}",
                  f["vs_plain"]] for v, f in capacity.items()])
    ratio = capacity["chunked"]["vs_plain"]
    print(f"\ntarget: the chunked head trains >= {fmt(TARGET)}x the plain head's context "
          f"under the same memory: {fmt(ratio)}x -> "
          f"{'MET' if ratio is not None and ratio >= TARGET else 'NOT MET'}")
    write_result("long_context", {
        "quick": quick, "model": MODEL, "loss_chunk": LOSS_CHUNK, "dtype": "fp32",
        "rows": 1, "threads": THREADS, "warmup_tokens": WARMUP_T,
        "sweep": sweep,
        "capacity": {"cap_bytes": cap, "cap_from": cap_from, "search_step": SEARCH_STEP,
                     "max_t": max_t, "by_variant": capacity},
        "target": TARGET, "ratio": ratio,
        "met": ratio is not None and ratio >= TARGET}, smoke=quick)


if __name__ == "__main__":
    is_worker, out, rest = worker_args(sys.argv[1:])
    if is_worker:
        worker(out, rest[0], int(rest[1]), int(rest[2]))
    else:
        main(rest)
