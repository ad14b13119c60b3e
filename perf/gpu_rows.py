"""``perf/gpu_check.py``'s training steps on one device: ``gpt2_124m``, ``trace``,
``llama_1b``, ``fp8`` and ``llama_1b_long``. Each takes a ``gpu_runs.Context`` and returns
its section (``gpu_verdict`` says what a section holds); sizes, steps and goals are the
constants below, with a tiny shape of each on the fake device (``make gpu-check DRY=1``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from hpctrain.report.trace_summary import summarize_run_traces
from perf.gpu_runs import Context, train
from perf.gpu_verdict import FAILED, NOT_POSSIBLE, OK, SKIPPED

MFU_GOALS = {"gpt2_124m": 0.50, "llama_1b": 0.45}
"""MFU the recipes should reach on one device (issue 45): GPT-2 124M at half the bf16
peak, Llama 1B a little lower (its 2048 context gives attention, which runs further from
the peak than the matrix multiplies, a larger share of the FLOPs)."""
FP8_LOSS_BOUND = 0.05
"""Largest |mean loss with FP8 - mean loss with bf16| over the last 50 of 200 steps of
gpt2-124m (same seed, same batches), in nats: about 1% of the loss there (5-6 nats), well
inside the step-to-step spread of one batch's loss; a wrong scale or an overflow leaves
the loss far higher, or not finite."""
FP8_STEPS, FP8_WINDOW = 200, 50

GPT2_TINY = ["--model.n_layer=2", "--model.n_embd=64", "--model.n_head=2",
             "--model.block_size=64", "--train.batch_size=8", "--parallel.micro_batches=2",
             "--train.compile=false"]
LLAMA_TINY = ["--model.n_layer=2", "--model.n_embd=64", "--model.n_head=4",
              "--model.n_kv_head=2", "--model.ffn_hidden=128", "--model.block_size=64",
              "--train.batch_size=8", "--parallel.micro_batches=2", "--train.compile=false"]
GPT2_ONE_MICRO = ["--train.batch_size=24", "--parallel.micro_batches=1"]
"""24 rows of 1024 in one micro-batch: the gpt2_124m step's micro-batch, so the trace
and FP8 runs reuse its compiled kernels (torch's on-disk cache)."""
LLAMA_CHECK = ["--train.batch_size=64", "--parallel.micro_batches=8"]
"""The recipe's micro-batch (8 rows of 2048), 8 of them a step instead of 32: a quarter
of its global batch, so a dozen steps fit the budget; the optimizer's share of a step is
four times the recipe's (the projection to the recipe's batch is recorded too)."""
LLAMA_STEPS = 12
LONG_SEQS, LONG_TOKENS, LONG_CHUNK = (4096, 8192, 16384, 32768), 16384, 4096
"""Sequence lengths tried ascending, rows = LONG_TOKENS // length (at least 1), with
every block recomputed and the head in LONG_CHUNK-token chunks."""
TINY_LONG_SEQS, TINY_LONG_TOKENS, TINY_LONG_CHUNK = (128, 256, 512, 1024), 256, 64


def _brief(r: dict) -> dict:
    """A run's section without its per-step losses and folder."""
    return {k: v for k, v in r.items() if k not in ("losses", "run_dir")}


def _memory_words(mem: dict | None) -> str:
    peak = (mem or {}).get("measured_peak_gib")
    if not peak:
        return ""
    ratio = mem.get("ratio")
    return f"peak {peak:.1f} GiB" + (f" = {ratio:.2f} x formula" if ratio else "")


def _mfu_row(section: dict, name: str) -> dict:
    """``key``, ``goal`` and ``met`` of a run measured against its MFU goal."""
    goal, mfu = MFU_GOALS[name], section.get("mfu")
    words = [f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a"]
    if section.get("tokens_per_s_steady"):
        words.append(f"{section['tokens_per_s_steady'] / 1e3:.0f}k tok/s")
    words.append(_memory_words(section.get("memory")))
    section.update(key=", ".join(w for w in words if w), goal=f"MFU >= {goal:.2f}",
                   met=None if mfu is None else mfu >= goal)
    return section


def gpt2_124m(ctx: Context, steps: int) -> dict:
    """The recipe as it is (24 rows per micro-batch, 20 of them), ``steps`` steps."""
    shape = GPT2_TINY if ctx.dry else ["--parallel.micro_batches=20"]
    r = _brief(train(ctx, "gpt2-124m", "gpt2-124m", [f"--train.max_iters={steps}", *shape]))
    return _mfu_row(r, "gpt2_124m") if r["status"] == OK else r


def trace(ctx: Context) -> dict:
    """gpt2-124m for a few steps under the torch profiler (``--train.profile``): the top
    kernels and the idle share per rank (``hpctrain.report.trace_summary``), and the
    run's step phases with the clock that timed them."""
    steps, window = (6, "3-4") if ctx.dry else (8, "5-7")
    shape = GPT2_TINY if ctx.dry else GPT2_ONE_MICRO
    r = train(ctx, "trace", "gpt2-124m", [f"--train.max_iters={steps}",
                                          f"--train.profile={window}", *shape])
    if r["status"] != OK:
        return _brief(r)
    ranks = summarize_run_traces(Path(r["run_dir"]))
    if not ranks:
        return {"status": FAILED, "error": f"--train.profile={window} wrote no trace under "
                f"{r['run_dir']}/trace", "phases_ms": r["phases_ms"], "clock": r["clock"]}
    per_rank = {str(k): s for k, s in ranks.items()}
    first = per_rank[min(per_rank, key=int)]
    top = first["top"][0] if first["top"] else {}
    return {"profile": window, "ranks": per_rank, "phases_ms": r["phases_ms"],
            "clock": r["clock"], "step_ms_median": r["step_ms_median"],
            "key": f"idle {100 * (first.get('idle_share') or 0):.0f}%, top "
                   f"{str(top.get('name', '?'))[:40]} {100 * (top.get('share') or 0):.0f}% "
                   f"({first.get('source', '?')})"}


def _llama_run(ctx: Context, name: str, extra: list[str], steps: int) -> dict:
    shape = LLAMA_TINY if ctx.dry else LLAMA_CHECK
    return train(ctx, name, "llama-1b", [f"--train.max_iters={steps}", *shape, *extra])


def llama_1b(ctx: Context) -> dict:
    """The recipe at its 2048 context and micro-batch, a dozen steps: tokens/s, MFU and
    the peak memory against the formula; MFU projected to the recipe's 32 micro-batches
    a step from the measured phases (the optimizer's time spread over 4x the tokens)."""
    r = _brief(_llama_run(ctx, "llama-1b", [], 5 if ctx.dry else LLAMA_STEPS))
    if r["status"] != OK:
        return r
    phases, mfu = r.get("phases_ms") or {}, r.get("mfu")
    if mfu and phases.get("step") and "optimizer" in phases:
        step, opt = phases["step"], phases["optimizer"]
        r["mfu_at_recipe_batch_projected"] = mfu * 4 * step / ((step - opt) * 4 + opt)
    return _mfu_row(r, "llama_1b")


def _long_words(tries: list[dict], longest: dict, seqs) -> str:
    words = f"longest {longest['seq']}"
    if longest.get("mfu"):
        words += f", MFU {100 * longest['mfu']:.1f}%"
    mem = _memory_words(longest.get("memory"))
    words += f", {mem}" if mem else ""
    last = tries[-1]
    if last["status"] != OK:
        why = "OOM" if last.get("oom") else "timed out" if last.get("timed_out") else "failed"
        words += f"; {last['seq']} {why}"
    elif len(tries) == len(seqs):
        words += " (every length tried fits)"
    return words


def llama_1b_long(ctx: Context) -> dict:
    """The longest context of the llama-1b recipe that trains on one device with every
    block recomputed and the head in chunks: lengths tried ascending, each a fresh run
    of 5 steps under what is left of the step's limit, stopping at the first that fails
    (out of memory, or any other error) or runs out of time."""
    seqs, tokens, chunk = ((TINY_LONG_SEQS, TINY_LONG_TOKENS, TINY_LONG_CHUNK) if ctx.dry
                           else (LONG_SEQS, LONG_TOKENS, LONG_CHUNK))
    tries, longest = [], None
    for seq in seqs:
        rows = max(1, tokens // seq)
        extra = [f"--model.block_size={seq}", f"--train.batch_size={rows}",
                 "--parallel.micro_batches=1", "--model.recompute=block",
                 f"--model.loss_chunk={chunk}"]
        r = _brief(_llama_run(ctx, f"llama-1b-{seq}", extra, 5))
        row = {"seq": seq, "rows": rows, "status": r["status"]}
        if r["status"] == OK:
            row.update({k: r.get(k) for k in ("step_ms_median", "tokens_per_s_steady", "mfu",
                                              "memory")})
            longest = row
        else:
            row.update(oom=r.get("oom"), timed_out=r.get("timed_out"), tail=r.get("tail"))
        tries.append(row)
        if r["status"] != OK:
            break
    section = {"tries": tries, "longest": longest}
    if longest is None:
        return {**section, "status": FAILED, "error": f"not even {seqs[0]} tokens trained"}
    return {**section, "key": _long_words(tries, longest, seqs)}


def loss_gap(a: dict[int, float], b: dict[int, float], window: int) -> dict:
    """Two runs' losses by step compared: |mean(a) - mean(b)| over the steps of the last
    ``window`` that both logged, and the largest per-step difference over all of them."""
    common = sorted(set(a) & set(b))
    if not common:
        return {"mean_gap": None, "max_step_gap": None, "steps_compared": 0}
    last = [s for s in common if s > common[-1] - window]
    gap = abs(statistics.fmean(a[s] for s in last) - statistics.fmean(b[s] for s in last))
    return {"mean_gap": gap, "max_step_gap": max(abs(a[s] - b[s]) for s in common),
            "steps_compared": len(last), "identical": all(a[s] == b[s] for s in common)}


def _speedup(fp8: dict, bf16: dict) -> float | None:
    a, b = fp8.get("tokens_per_s_steady"), bf16.get("tokens_per_s_steady")
    return a / b if a and b else None


def fp8_refused(r: dict) -> bool:
    """Whether a run with ``--train.fp8=true`` was refused for FP8 (exit 2 naming it):
    what a device without FP8 units says. Any other failure is a finding."""
    return r.get("exit") == 2 and "fp8" in r.get("refusal", "").lower()


def fp8(ctx: Context) -> dict:
    """gpt2-124m with ``--train.fp8=true`` against bf16 over 200 steps (one 24-row
    micro-batch a step, same seed and batches): the loss gap (``FP8_LOSS_BOUND``) and the
    speed-up; then llama-1b's speed-up over a dozen steps (bf16: the llama_1b step's
    run when there is one). A device without FP8 units refuses: not possible."""
    steps = 20 if ctx.dry else FP8_STEPS
    shape = GPT2_TINY if ctx.dry else GPT2_ONE_MICRO
    runs = {}
    for name, flag in (("fp8", "true"), ("bf16", "false")):
        runs[name] = train(ctx, f"gpt2-124m-{name}", "gpt2-124m",
                           [f"--train.max_iters={steps}", f"--train.fp8={flag}", *shape],
                           log_interval=1 if ctx.dry else 5)
        if name == "fp8" and fp8_refused(runs[name]):
            return {"status": NOT_POSSIBLE, "why": runs[name]["refusal"]}
        if runs[name]["status"] != OK:
            return {**_brief(runs[name]), "run": f"gpt2-124m {name}"}
    gap = loss_gap(runs["fp8"]["losses"], runs["bf16"]["losses"], FP8_WINDOW)
    gpt2 = {"loss": gap, "speedup": _speedup(runs["fp8"], runs["bf16"]),
            "fp8": _brief(runs["fp8"]), "bf16": _brief(runs["bf16"])}
    llama_steps = 5 if ctx.dry else LLAMA_STEPS
    fp8_run = _brief(_llama_run(ctx, "llama-1b-fp8", ["--train.fp8=true"], llama_steps))
    earlier = ctx.sections.get("llama_1b", {})
    reuse = earlier.get("status") == OK
    bf16_run = earlier if reuse else _brief(_llama_run(ctx, "llama-1b-bf16", [], llama_steps))
    llama = {"speedup": _speedup(fp8_run, bf16_run), "fp8": fp8_run,
             "bf16_from": "the llama_1b step" if reuse else "its own run"}
    words = [f"gap {gap['mean_gap']:.3f}" if gap["mean_gap"] is not None else "gap n/a"]
    words += [f"x{s:.2f} {n}" for n, s in (("gpt2", gpt2["speedup"]),
                                           ("llama", llama["speedup"])) if s]
    section = {"gpt2_124m": gpt2, "llama_1b": llama, "key": ", ".join(words),
               "goal": f"gap <= {FP8_LOSS_BOUND}",
               "met": None if gap["mean_gap"] is None else gap["mean_gap"] <= FP8_LOSS_BOUND}
    if gap.get("identical"):
        section["note"] = "identical losses: --train.fp8 changed nothing here"
    if fp8_run.get("timed_out"):  # the budget ran out: rerun the step, not a finding
        section.update(status=SKIPPED, why="llama-1b with --train.fp8=true ran out of time")
    elif fp8_run["status"] != OK:
        section.update(status=FAILED, error="llama-1b with --train.fp8=true failed")
    return section
