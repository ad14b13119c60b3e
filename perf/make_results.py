"""Write perf/RESULTS.md from perf/results/*.json, so the document cannot drift from
the measurements (tests/test_results_doc.py regenerates it and compares).

Every section states where its numbers come from (commit, clean or dirty tree, date,
machine) and gives repeated measurements as median [min, max] (convergence: mean [min,
max] over seeds), computed here from the raw values each JSON keeps; figures use the
benchmarks' own formatter (``perf.common.fmt``). JSON written before a field existed is
rendered with what it has ("unknown", "n/a", "not recorded").

    python perf/make_results.py            # or: make results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.common import RESULTS, ROOT, fmt, fmt_spread  # noqa: E402
from perf.render_data import render_prepare  # noqa: E402
from perf.render_memory import (render_long_context, render_memory,  # noqa: E402
                                render_recompute)
from perf.render_parallel import (render_cp, render_pipeline, render_tp,  # noqa: E402
                                  render_zero, render_zero_bubble)
from perf.results_format import md_table, provenance  # noqa: E402
from perf.bench_perfmodel import render_perfmodel  # noqa: E402
from perf.render_moe import render_moe  # noqa: E402
from perf.bench_ckpt_files import render_ckpt_files  # noqa: E402
from perf.gpu_verdict import VERDICT_COLUMNS, verdict_rows  # noqa: E402
from hpctrain.sizes import MiB  # noqa: E402

DOC = ROOT / "perf" / "RESULTS.md"


# ------------------------------------------------------------------------ sections

def render_allreduce(d: dict) -> list[str]:
    methods = [("bucketed", "bucketed (shm)"), ("bucketed_mpi", "bucketed MPI"),
               ("bucketed_iallreduce", "bucketed Iallreduce"), ("raw_mpi", "raw MPI"),
               ("bucketed_xccl", "bucketed xccl (gloo)"), ("gloo", "gloo")]
    methods = [(k, label) for k, label in methods if k in d["records"][0]["busbw_GBps"]]
    rows = []
    for r in d["records"]:
        factor = 2 * (r["ranks"] - 1) / r["ranks"]
        every = r.get("time_ms_all", {})

        def bw(k):
            if every.get(k):
                return fmt_spread([r["bytes"] * factor / (t / 1e3) / 1e9 for t in every[k]])
            return fmt(r["busbw_GBps"][k])

        bws = r["busbw_GBps"]
        rows.append([r["ranks"], r["model"], fmt(r["bytes"] / MiB), r["buckets"],
                     r.get("transport", "unknown"), *(bw(k) for k, _ in methods),
                     fmt(bws["bucketed"] / bws["raw_mpi"]), fmt(bws["bucketed"] / bws["gloo"])])
    n = d.get("repeats", 21)
    spread_note = ("median [min, max]" if any(r.get("time_ms_all") for r in d["records"])
                   else "median (min and max not recorded in this JSON)")
    out = [f"Bus bandwidth (GB/s) of one gradient reduction, {spread_note} of {n} timed "
           "batches; ratios from the medians.", "",
           *md_table(["ranks", "model", "MiB", "buckets", "transport",
                    *(label for _, label in methods), "bucketed/raw", "bucketed/gloo"], rows)]
    if "worst_bucketed_over_raw" in d:
        out += [f"Target bucketed >= {fmt(d.get('target', 0.9))}x raw MPI: worst "
                f"{fmt(d['worst_bucketed_over_raw'])}x -> {'met' if d.get('met') else 'missed'}.",
                ""]
    steps = [r for r in d["records"] if r.get("step_ms_all")]
    if steps:
        def ms(r, k):
            return fmt_spread(r["step_ms_all"][k])

        out += ["A backward step with its reduction (ms, median [min, max]): our buckets "
                "over MPI, our buckets over gloo (`--comm.transport=xccl` on CPUs), torch "
                "DDP over gloo; each on its own copy of the model.", "",
                *md_table(["ranks", "model", "ours MPI", "ours gloo", "DDP gloo",
                         "DDP / ours gloo"],
                        [[r["ranks"], r["model"], ms(r, "ours_mpi"), ms(r, "ours_gloo"),
                          ms(r, "ddp_gloo"),
                          fmt(r["step_ms"]["ddp_gloo"] / r["step_ms"]["ours_gloo"])]
                         for r in steps])]
    return out


def render_dp(d: dict) -> list[str]:
    phases = [("dp1", "DP=1"), ("pair", "2 x DP=1 at once"), ("dp2", "DP=2"),
              ("ddp2", "torch DDP, 2 ranks")]
    ratios = [("weak_scaling_efficiency", "weak-scaling eff."),
              ("contention_ceiling", "contention ceiling"),
              ("communication_efficiency", "communication eff."), ("vs_ddp", "vs DDP")]
    tput, rat = [], []
    for name, m in d["models"].items():
        rounds = m.get("all_rounds", [])
        cells = [fmt_spread([r["tokens_per_s"][k] for r in rounds]) if rounds
                 else fmt(m["tokens_per_s"][k]) for k, _ in phases]
        single = fmt_spread(m["single2t_runs"]) if m.get("single2t_runs") \
            else fmt(m["tokens_per_s"].get("single2t"))
        tput.append([name, m["per_rank_batch"], m.get("rounds", "?"), *cells, single])
        rat.append([name, *(fmt_spread(m["per_round"][k]) if m.get("per_round", {}).get(k)
                            else fmt(m.get(k)) for k, _ in ratios),
                    fmt(m.get("vs_single_2threads"))])
    out = ["Training throughput, tokens/s, median [min, max] over rounds (the 1-process "
           "column: over its runs).", "",
           *md_table(["model", "batch/rank", "rounds", *(label for _, label in phases),
                    "1 process, 2 threads"], tput),
           "Ratios, each taken within a round: median [min, max] over rounds (vs 1 process: "
           "from the medians).", "",
           *md_table(["model", *(label for _, label in ratios), "vs 1 process 2 threads"], rat)]
    t = d.get("targets", {})
    if t:
        out += [f"Targets: weak-scaling efficiency >= {fmt(t.get('efficiency'))}, >= "
                f"{fmt(t.get('vs_ddp'))}x torch DDP -> {'met' if d.get('met') else 'missed'}.", ""]
    if d.get("end_to_end"):
        out += render_dp_end_to_end(d["end_to_end"], t.get("end_to_end_efficiency"))
    return out


def render_dp_end_to_end(e2e: dict, target) -> list[str]:
    """The same configurations as separate jobs of ``hpctrain train`` (--end-to-end)."""
    configs = [("alone", "1 rank"), ("pair", "2 x 1 rank at once"), ("dp2", "DP=2"),
               ("ddp2", "torch DDP, 2 ranks")]
    ratios = [("efficiency", "DP=2 / ceiling"), ("weak_scaling", "weak-scaling eff."),
              ("ceiling", "contention ceiling"), ("vs_ddp", "vs DDP")]
    tput, phases = [], []
    for name, m in e2e.items():
        runs = m["runs"]
        tput.append([name, m["rounds"], m["steps_per_job"],
                     *(fmt_spread([r["tokens_per_s"][k] for r in runs]) for k, _ in configs),
                     *(fmt_spread([r[k] for r in runs]) for k, _ in ratios)])
        alone, dp2 = m["phases_ms"]["alone"], m["phases_ms"]["dp2"]
        for k in alone:
            phases.append([name, k, fmt(alone[k]), fmt(dp2.get(k)),
                           fmt((dp2.get(k) or 0.0) - alone[k])])
    goal = f" Goal: DP=2 >= {fmt(target)} of the ceiling." if target else ""
    return ["End to end: each configuration a separate `mpiexec` job of `hpctrain train` "
            "(torch DDP: its own job), one thread per rank, median `step_ms` of "
            "`metrics.jsonl` after the warm-up; configurations rotate within each round. "
            f"Tokens/s and ratios, median [min, max] over the rounds.{goal}", "",
            *md_table(["model", "rounds", "steps/job", *(label for _, label in configs),
                     *(label for _, label in ratios)], tput),
            "Where a step's time goes (`summary.json` `timing.phases_ms`: ms per step, "
            "median over the rounds; DP=2 averaged over its ranks; hooks are part of "
            "backward).", "",
            *md_table(["model", "phase", "1 rank", "DP=2", "DP=2 - 1 rank"], phases)]


CONVERGENCE_ROWS = {
    "hpctrain_dp2": "hpctrain, 2 ranks x 1 thread",
    "baseline_matched": "nanoGPT-style, 1 process x 2 threads, hpctrain's AdamW + sampler",
    "nanogpt_style_1proc_2threads": "nanoGPT-style, 1 process x 2 threads, nanoGPT defaults",
}


def render_convergence(d: dict) -> list[str]:
    labels = {**CONVERGENCE_ROWS, **d.get("rows", {})}
    runs = d["runs"]
    present = [k for k in labels if k in runs[0]]
    seeds = [r["seed"] for r in runs]
    rows = [[labels[k], len(runs),
             fmt_spread([r[k]["final_val_loss"] for r in runs], center="mean"),
             fmt_spread([r[k]["wall_s"] for r in runs], center="mean"),
             fmt_spread([r[k]["step_ms_median"] for r in runs], center="mean")]
            for k in present]
    steps = d.get("steps", 2000)
    out = [f"shakespeare-char, {steps} steps, seed(s) {', '.join(map(str, seeds))}: "
           "whole-split validation loss and wall time, mean [min, max] over the seeds.", "",
           *md_table(["run", "seeds", "val loss", "wall s", "step ms (median per run)"], rows),
           "Per seed: val loss / wall s.", "",
           *md_table(["seed", *(labels[k] for k in present)],
                   [[r["seed"], *(f"{fmt(r[k]['final_val_loss'])} / {fmt(r[k]['wall_s'])}"
                                  for k in present)] for r in runs])]
    checks = d.get("seed_checks")
    if checks:
        failed = [f"{k}: {c}" for k, v in checks.items() for c, ok in v.items() if ok is False]
        out += ["Seeds change the initial weights and the data order of every row: "
                + ("yes." if not failed else "NO (" + ", ".join(failed) + ")."), ""]
    target = d.get("targets", {}).get("val_loss")
    if target is not None:
        met = d.get("met")
        out += [f"Targets: hpctrain's mean val loss <= {fmt(target)}, wall time <= the "
                f"baseline's -> {'met' if met else 'not checked' if met is None else 'missed'}.",
                ""]
    return out


def render_checkpoint(d: dict) -> list[str]:
    rec = d["records"]
    torch_r = rec["torch"]
    gb = torch_r["bytes"] / 1e9

    def row(method, n, r):
        return [method, n, fmt_spread(r["all_s"]["save"]), fmt(gb / r["save_s"]),
                fmt_spread(r["all_s"]["load"]), fmt(gb / r["load_s"]),
                fmt(torch_r["save_s"] / r["save_s"]), fmt(torch_r["load_s"] / r["load_s"])]

    rows = [row("torch.save/load", 1, torch_r)]
    rows += [row("hpctrain sharded", n, r) for n, r in rec["hpctrain"].items()]
    repeats = len(torch_r["all_s"]["save"])
    out = [f"Checkpoint of {fmt(torch_r['params'] / 1e6)}M parameters "
           f"({fmt(torch_r['bytes'] / MiB)} MiB: fp32 parameters + Adam moments); seconds, "
           f"median [min, max] of {repeats}; GB/s and ratios from the medians.", "",
           *md_table(["method", "ranks", "save s", "save GB/s", "load s", "load GB/s",
                    "save vs torch", "load vs torch"], rows)]
    tr = rec.get("training")
    if tr:
        med = tr["median_s"]
        out += ["Training wall time (s), 20 steps with a checkpoint every 5 (10.7M parameters, "
                "2 ranks, ZeRO-1), median [min, max] over rounds; overhead from the medians.",
                "",
                *md_table(["checkpoints", "wall s", "overhead"],
                        [[k, fmt_spread(v), fmt(med[k] / med["none"] - 1)]
                         for k, v in tr["wall_s"].items()])]
    st = rec.get("stall")
    if st:
        out += _render_stall(st)
    return out


def _render_stall(st: dict) -> list[str]:
    """The training stall per checkpoint, async vs synchronous (bench_checkpoint's third
    part), and the step time of the steps that overlap a write."""
    sync_med = sorted(st["sync_save_s"])[len(st["sync_save_s"]) // 2]
    rows = [[m, fmt_spread(st["stall_s"][m]), fmt(st["median_stall_s"][m] / sync_med),
             fmt_spread(st["first_stall_s"][m]), fmt_spread(st["wall_s"][m])]
            for m in ("sync", "async")]
    met = "met" if st["stall_ratio"] <= st["goal_ratio"] else "missed"
    steps = [["write in flight", len(st["step_s_in_flight"]), fmt_spread(st["step_s_in_flight"]),
              fmt(st["overlap_cost"])],
             ["no write", len(st["step_s_no_write"]), fmt_spread(st["step_s_no_write"]), "0"]]
    sync = fmt_spread(st["sync_save_s"])
    return [f"Training stall per checkpoint, one rank, {st['model']} (~0.9 GB of state): "
            f"the main thread's time in the saver; synchronous save {sync} s. "
            "The 2nd and 3rd checkpoints of a run, and apart the 1st (its copy allocates the host "
            f"buffers). Goal: async stall <= {fmt(st['goal_ratio'])} of the synchronous save -> "
            f"{met} ({fmt(st['stall_ratio'])}).", "",
            *md_table(["checkpoints", "stall s", "stall / sync save", "1st stall s",
                       "run wall s"], rows),
            "Step time of the asynchronous runs (the first step of each aside): steps "
            "trained while a write was in flight against the others; cost = ratio of medians - 1.",
            "", *md_table(["steps", "n", "step s", "cost"], steps)]


def render_io(d: dict) -> list[str]:
    rows = []
    for r in d["reads"].values():
        rd = r["rounds"]
        med = r["median_MBps"]
        rows.append([r["ranks"], r["cache"], fmt_spread(rd["mpiio"]), fmt_spread(rd["memmap"]),
                     fmt(med["mpiio"] / med["memmap"]), fmt_spread(rd["memmap_random"]),
                     fmt(med["mpiio"] / med["memmap_random"]), fmt_spread(rd["view"])])
    out = ["Read bandwidth, aggregate MB/s, median [min, max] over rounds; ratios from the "
           "medians.", "",
           *md_table(["ranks", "cache", "MPI-IO (hpctrain)", "np.memmap (nanoGPT)",
                    "MPI-IO/memmap", "memmap + MADV_RANDOM", "MPI-IO/that",
                    "MPI-IO, one call + file view"], rows)]
    wait = d.get("data_wait")
    if wait:
        out += [f"Data wait while training shakespeare-char on {wait['ranks']} ranks, "
                f"{wait['steps']} steps: data wait as % of step time, median [min, max] over "
                "runs.", "",
                *md_table(["reader", "data ms/step", "step ms", "data wait %"],
                        [[name, fmt(c["data_ms"]), fmt(c["step_ms"]),
                          fmt_spread(c["all_shares"], 100)]
                         for name, c in wait["configs"].items()])]
    if "worst_ratio" in d:
        out += [f"Targets: MPI-IO >= 0.8x memmap (worst {fmt(d['worst_ratio'])}x), data wait "
                f"< 2% (default reader {fmt(d['data_wait_share'], 100)}%) -> "
                f"{'met' if d.get('met') else 'missed'}.", ""]
    return out


def render_gpu(d: dict) -> list[str]:
    s = d["sections"]
    env = s["environment"]
    out = [f"{env.get('name', env['device'])}, torch {env['torch']}, {env['mpi'].strip(chr(0))}"
           + (f", NCCL {env['nccl']}" if env.get("nccl") else "") + ". Steps: "
           + ", ".join(f"{k} {v['status']}" for k, v in s.items()) + ".", ""]
    if any("key" in v for v in s.values()):  # a check that writes its verdict per step
        out += md_table(VERDICT_COLUMNS, verdict_rows(s))
    g = s.get("gpt2_124m", {})
    if g.get("status") == "ok":
        mem = g["device_memory"][0].split("device: ")[-1] if g["device_memory"] else ""
        rows = [["gpt2-124m, bf16, compiled, 1 device", g["steps"], g["tokens_per_step"],
                 fmt(g["step_ms_median"]), fmt(g["tokens_per_s_steady"] / 1e3),
                 fmt(100 * g["mfu"]) if g.get("mfu") else "n/a",
                 f"{g['peak']['tflops']:g} ({g['peak']['basis']})"
                 if g["peak"].get("tflops") else "n/a", mem]]
        out += md_table(["run", "steps", "tokens/step", "median step ms", "k tokens/s",
                       "MFU %", "peak TFLOP/s", "device memory"], rows)
        phases = g.get("phases_ms") or {}
        if phases:
            out += ["Median ms per step by phase: " + ", ".join(
                f"{k} {fmt(v)}" for k, v in phases.items() if k != "step") + ".", ""]
    e = s.get("equivalence", {})
    if e.get("runs"):
        rows = []
        for name, r in e["runs"].items():
            syncs = r.get("syncs_per_step")
            rows.append([name, r.get("transport", ""), r.get("status", "ok"),
                         f"{r['max_loss_diff']:.1e}" if "max_loss_diff" in r else "",
                         f"{r['max_param_diff']:.1e}" if "max_param_diff" in r else "",
                         ", ".join(map(str, syncs)) if syncs else "",
                         r.get("why", "")])
        out += ["The same fp32 training (TF32 off) at 1 rank and at 2 ranks sharing the "
                "device: the largest differences from the 1-rank run, and the host's waits "
                "for the device per step after two warm-up steps (CUDA's sync debug mode).",
                "", *md_table(["run", "transport", "status", "max loss diff",
                             "max param diff", "host syncs per step", "note"], rows)]
    doc = s.get("doctor", {}).get("ranks_1", {})
    if doc.get("allreduce"):
        rows = [[r.get("size_mib", ""), r["memory"], r.get("transport", ""),
                 fmt(r["busbw_GBps"]) if "busbw_GBps" in r else r["status"],
                 "staged" if r.get("staged") else ""] for r in doc["allreduce"]]
        t = doc.get("train") or {}
        out += ["`hpctrain doctor` at 1 rank: allreduce bus bandwidth (GB/s; one rank "
                "moves nothing between ranks: these are copies), and its compiled training "
                f"step: {t.get('model')} at {fmt(100 * t['mfu']) if t.get('mfu') else 'n/a'}% "
                "MFU.", "", *md_table(["MiB", "memory", "through", "busbw GB/s", ""], rows)]
    failures = s.get("doctor", {}).get("ranks_2", {}).get("failures") or []
    if failures:
        out += ["`hpctrain doctor` at 2 ranks on the one device (meant to fail): "
                + "; ".join(f.split(":")[0] for f in failures) + ".", ""]
    return out


# name -> (title, command, renderer), in the Makefile's order
SECTIONS = {
    "allreduce": ("Gradient allreduce", "python perf/bench_allreduce.py", render_allreduce),
    "dp": ("Data-parallel throughput", "python perf/bench_dp.py --shakespeare PATH", render_dp),
    "convergence": ("Convergence and time to solution",
                    "python perf/bench_convergence.py --shakespeare PATH", render_convergence),
    "zero": ("ZeRO memory and speed", "python perf/bench_zero.py --shakespeare PATH",
             render_zero),
    "checkpoint": ("Checkpoints", "python perf/bench_checkpoint.py --shakespeare PATH",
                   render_checkpoint),
    "ckpt_files": ("Checkpoint files per rank or per node", "python perf/bench_ckpt_files.py",
                   render_ckpt_files),
    "io": ("Data reading", "python perf/bench_io.py --shakespeare PATH", render_io),
    "prepare": ("Preparing corpora", "python perf/bench_prepare.py", render_prepare),
    "pipeline": ("Pipeline parallelism", "python perf/bench_pipeline.py", render_pipeline),
    "zero_bubble": ("Zero-bubble pipelines", "python perf/bench_zero_bubble.py",
                    render_zero_bubble),
    "tp": ("Tensor parallelism", "python perf/bench_tp.py --shakespeare PATH", render_tp),
    "long_context": ("Long context: chunked loss and recomputation",
                     "python perf/bench_long_context.py", render_long_context),
    "perfmodel": ("Performance model against published runs",
                  "python perf/bench_perfmodel.py", render_perfmodel),
    "memory": ("Memory of one rank against the formula and plain torch",
               "python perf/bench_memory.py", render_memory),
    "recompute": ("Activation recomputation", "python perf/bench_recompute.py",
                  render_recompute),
    "cp": ("Context parallelism: ring attention", "python perf/bench_cp.py", render_cp),
    "moe": ("Mixtures of experts and expert parallelism",
            "python perf/bench_moe.py --shakespeare PATH", render_moe),
}


def render(results: Path = RESULTS) -> str:
    lines = ["# Benchmark results", "",
             "Generated by `make results` (`perf/make_results.py`) from `perf/results/*.json`; "
             "do not edit by hand. Each benchmark's docstring (`perf/bench_*.py`) says what "
             "is measured and how. Repeated measurements are given as median [min, max] "
             "unless a table says otherwise. `make bench` runs them all.", ""]
    for name, (title, command, fn) in SECTIONS.items():
        lines += [f"## {title}", "", f"`{command}` -> `perf/results/{name}.json`", ""]
        path = results / f"{name}.json"
        if not path.exists():
            lines += ["No result yet.", ""]
            continue
        d = json.loads(path.read_text())
        lines += [provenance(d), "", *fn(d)]
    lines += ["## GPU check", "", "`make gpu-check` on a GPU node -> "
              "`perf/results/gpu-<device>.json`", ""]
    gpus = sorted(results.glob("gpu-*.json"))
    for path in gpus:
        d = json.loads(path.read_text())
        lines += [f"### {path.stem}", "", provenance(d), "", *render_gpu(d)]
    if not gpus:
        lines += ["No GPU check has run yet.", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    DOC.write_text(render())
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
