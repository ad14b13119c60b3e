"""The sections of perf/RESULTS.md for the parallel layouts: ZeRO, pipelines, tensor
and context parallelism (``perf/make_results.py`` puts them in order)."""

from __future__ import annotations

from perf.common import fmt, fmt_spread
from perf.results_format import median_of, ratio_of, md_table
from hpctrain.sizes import MiB


def render_zero(d: dict) -> list[str]:
    rows = []
    for r in d["memory_and_speed"]:
        step = fmt_spread(r["step_ms_all"]) if r.get("step_ms_all") else fmt(r["step_ms"])
        rows.append([r["ranks"], r["dtype"], r["stage"], fmt(r["bytes_per_param"]),
                     fmt(float(r["formula"])), fmt(r["vs_formula"]),
                     fmt(r["memory"]["comm_buffers"] / MiB), step, fmt(r["step_vs_stage0"])])
    step_note = ("median [min, max] over the steps" if any(
        r.get("step_ms_all") for r in d["memory_and_speed"]) else "median over the steps")
    out = [f"Model-state bytes per parameter per rank against the ZeRO formulas; step time "
           f"(ms) {step_note}, slowest rank.", "",
           *md_table(["ranks", "dtype", "stage", "B/param", "formula", "ratio", "comm MiB",
                    "step ms", "vs stage 0"], rows)]
    vs = []
    for r in d.get("vs_torch_zero", []):
        ours = r["all_ms"]["hpctrain"]
        for key, label in (("torch", "defaults"),
                           ("torch_bucket_view", "parameters_as_bucket_view=True")):
            theirs = r["all_ms"].get(key)
            if theirs:
                vs.append([r["ranks"], label, fmt_spread(ours), fmt_spread(theirs),
                           fmt(ratio_of(median_of(theirs), median_of(ours)))])
    if vs:
        out += ["ZeRO-1 against torch's ZeroRedundancyOptimizer (DDP + gloo), step ms, "
                "median [min, max] over interleaved rounds; speedup = torch / hpctrain "
                "(medians).", "",
                *md_table(["ranks", "ZeroRedundancyOptimizer", "hpctrain ZeRO-1 ms", "torch ms",
                         "speedup"], vs)]
    cap = d.get("capacity", {})
    found = [(s, c) for s, c in cap.get("by_stage", {}).items() if c]
    if found:
        out += [f"Largest GPT training on 4 ranks under {cap.get('cap_mib')} MiB peak RSS "
                "growth per rank (one run per width, binary search).", "",
                *md_table(["stage", "width", "parameters", "peak growth MiB"],
                        [[s, c["width"], c["params"], fmt(c["peak_rss_growth"] / MiB)]
                         for s, c in found]),
                f"ZeRO-3 / DP parameters: {fmt(cap.get('ratio'))}x (target >= 3).", ""]
    if "worst_formula_deviation" in d:
        out += [f"Worst deviation from the formulas: {fmt(d['worst_formula_deviation'])} "
                "(target <= 0.05).", ""]
    return out


def _pipeline_vs_torch(d: dict) -> list[dict]:
    """Rows of the comparison with torch; the old format (our 1F1B and interleaved
    against torch's 1F1B, best of 2) is mapped onto the current one."""
    rows = []
    for r in d.get("vs_torch", []):
        if "schedule" in r:
            rows.append(r)
            continue
        rows.append({"p": r["p"], "m": r["m"], "schedule": "1f1b", "virtual": 1,
                     "torch_class": "Schedule1F1B", "ours": {"step_s": r["ours_step_s"]},
                     "torch": {"step_s": r["torch_step_s"]},
                     "speedup_per_round": [t / o for t, o in zip(r["torch_step_s"],
                                                                 r["ours_step_s"])]})
        if r.get("ours_interleaved_v2_step_s"):
            rows.append({"p": r["p"], "m": r["m"], "schedule": "interleaved", "virtual": 2,
                         "torch_class": "not measured",
                         "ours": {"step_s": r["ours_interleaved_v2_step_s"]}, "torch": {},
                         "speedup_per_round": []})
    return rows


def render_pipeline(d: dict) -> list[str]:
    a, b = [], []
    for r in d["bubble"]:
        for kind in ("1f1b", "gpipe"):
            k = r[kind]
            per = k.get("per_step")
            if per:
                a.append([r["p"], r["m"], kind, fmt(k["bubble_theory"]),
                          fmt_spread(per["bubble"]), fmt_spread(per["efficiency"]),
                          fmt_spread(per["step_s"], 1e3)])
            else:  # before per-step lists: one figure, no efficiency
                a.append([r["p"], r["m"], kind, fmt(k["bubble_theory"]),
                          fmt(k.get("bubble_measured")), "not recorded", fmt(k["step_s"], 1e3)])
        b.append([r["p"], r["m"], fmt(r["1f1b"]["act_bytes_max"] / MiB),
                  fmt(r["gpipe"]["act_bytes_max"] / MiB), fmt(r["act_ratio"]),
                  fmt(r["act_target"]),
                  "met" if r["act_ratio"] <= 1.1 * r["act_target"] else "missed"])
    steps = d.get("steps", "?")
    how = (f"median [min, max] over {steps} steps of one run" if a and d["bubble"][0]["1f1b"].get(
        "per_step") else f"this JSON predates per-step lists: the mean over {steps} steps "
           "(bubble) and the slowest stage's median (step time)")
    out = [f"A. Bubble: share of the pipeline phase a stage spends blocked on a neighbour "
           f"(mean over stages) against (p - 1) / (m + p - 1); efficiency = busiest stage's "
           f"forward + backward time / the pipeline phase (<= 1; optimizer outside both); "
           f"{how}.", "",
           *md_table(["p", "m", "schedule", "theory", "measured", "efficiency", "step ms"], a),
           "B. Peak activation memory per step, worst stage (MiB); target 1F1B <= 1.1 p/m "
           "x GPipe.", "",
           *md_table(["p", "m", "1F1B", "GPipe", "ratio", "p/m", "target"], b)]
    c = []
    for r in _pipeline_vs_torch(d):
        name = r["schedule"] + (f" v={r['virtual']}" if r.get("virtual", 1) > 1 else "")
        theirs = r["torch"].get("step_s")
        c.append([r["p"], r["m"], name, r["torch_class"], fmt_spread(r["ours"]["step_s"], 1e3),
                  fmt_spread(theirs, 1e3) if theirs else "n/a",
                  fmt_spread(r["speedup_per_round"]) if r["speedup_per_round"] else "n/a",
                  fmt_spread(r["ours"].get("efficiency")) if r["ours"].get("efficiency")
                  else "n/a",
                  fmt_spread(r["torch"].get("efficiency")) if r["torch"].get("efficiency")
                  else "n/a"])
    rounds = d.get("rounds")
    how = (f"median [min, max] over {rounds} rounds" if rounds else
           "the 2 rounds as median [min, max] (this JSON predates medians of >= 3 rounds; "
           "its own summary was the best of 2)")
    out += [f"C. Step time (ms, optimizer step included) of our schedules against "
            f"torch.distributed.pipelining's schedule of the same kind, same stages, "
            f"micro-batches and AdamW; {how}; speedup = torch / ours per round.", "",
            *md_table(["p", "m", "schedule", "torch schedule", "ours ms", "torch ms",
                     "speedup", "ours efficiency", "torch efficiency"], c)]
    if "target_vs_torch" in d:
        worst = min(median_of(r["speedup_per_round"]) for r in _pipeline_vs_torch(d)
                    if r["schedule"] == "1f1b")
        out += [f"Target: our 1F1B >= {fmt(d['target_vs_torch'])}x torch's Schedule1F1B: "
                f"worst {fmt(worst)}x -> {'met' if d.get('met') else 'missed'}.", ""]
    return out


def render_zero_bubble(d: dict) -> list[str]:
    from perf.bench_zero_bubble import (BUBBLE_COLUMNS, CEILING_COLUMNS, MEMORY_COLUMNS,
                                        SPEED_COLUMNS, bubble_rows, ceiling_rows,
                                        memory_rows, speed_rows)

    records, rounds = d["records"], d.get("rounds")
    return [f"Our zb-h1 and zbv (backward split into B and W) against torch's Schedule1F1B, "
            f"its zero-bubble schedule of the same kind (ScheduleInterleavedZeroBubble with "
            f"one stage per rank; ScheduleZBVZeroBubble) and our 1F1B; step ms, optimizer "
            f"included, median [min, max] over {rounds} rounds; speedup = theirs / ours "
            f"per round.", "", *md_table(SPEED_COLUMNS, speed_rows(records)),
            "Bubble: idle share of all stages (1 - compute summed / (p x pipeline phase)) "
            "measured, against the simulator's prediction for the same schedule with each "
            "stage's passes (F, B, W) taking their measured time (zbv: the mean of its two "
            "chunks), and in units (F = B = W; the first chunk's B empty, its W two units).",
            "", *md_table(BUBBLE_COLUMNS, bubble_rows(records)),
            "Ceiling: torch's 1F1B step over a step without any bubble (the optimizer step "
            "plus the busiest stage's compute, from the same job): the most a schedule "
            "could gain with our split backward as measured, and with a free split (our "
            "1F1B's fused backward). Split cost: zb-h1's busiest-stage compute over our "
            "1F1B's.", "", *md_table(CEILING_COLUMNS, ceiling_rows(records)),
            *([f"Memory at m = {d.get('memory_m', 8)}: each stage's peak activation bytes "
               "within a step (heap in use after every forward, less the heap at the "
               "step's start), worst stage against 1F1B's, beside the simulator's most "
               "micro-batches a stage holds until their last backward pass (W; a zbv chunk "
               "counts half).", "", *md_table(MEMORY_COLUMNS, memory_rows(d["memory"]))]
              if d.get("memory") else []),
            "Targets: " + "; ".join(f"{name} {'met' if ok else 'missed'}"
                                    for name, ok in d["met"].items()) + ".", ""]


def render_tp(d: dict) -> list[str]:
    mem = [[r["tp"], "yes" if r["sequence_parallel"] else "no",
            fmt(r["model_state_bytes"] / MiB), fmt(r["model_state_formula"] / MiB),
            fmt(r["activation_bytes"] / MiB), fmt(r["activation_formula"] / MiB),
            fmt(r["activation_vs_formula"])] for r in d["memory"]]
    out = ["Per rank (MiB): model state (fp32 parameters, gradients, AdamW moments) and the "
           "bytes the blocks keep for backward, against the formulas "
           "(docs/design/tensor-parallel.md).", "",
           *md_table(["tp", "sequence parallel", "model state", "formula", "activations",
                    "formula", "ratio"], mem)]
    speed = [[r["tp"], fmt_spread(r["all_ms"]["hpctrain"]),
              fmt_spread(r["all_ms"]["hpctrain_sp"]), fmt_spread(r["all_ms"]["torch"]),
              fmt(ratio_of(median_of(r["all_ms"]["torch"]), median_of(r["all_ms"]["hpctrain"])))]
             for r in d["vs_torch_tp"]]
    out += ["Step time (ms) against `torch.distributed.tensor.parallel` (ColwiseParallel / "
            "RowwiseParallel over gloo), same model, weights and batches, median [min, max] "
            "over interleaved rounds of the slowest rank's median step; speedup = torch / "
            "hpctrain without sequence parallelism (target >= 1.2).", "",
            *md_table(["tp", "hpctrain ms", "hpctrain + sequence parallel ms", "torch TP ms",
                     "speedup"], speed)]
    cap = d.get("capacity", {})
    rows = [[f"{b['rows']} x {b['block']}", k, c["width"], c["params"],
             fmt(c["peak_rss_growth"] / MiB)]
            for b in cap.get("batches", []) for k, c in b["by_layout"].items() if c]
    if rows:
        ratios = "; ".join(f"{b['rows']} x {b['block']} tokens: {fmt(b['ratio'])}x"
                           for b in cap["batches"])
        out += [f"Largest GPT training on 4 ranks under {cap.get('cap_mib')} MiB peak RSS "
                "growth per rank, per global batch (rows x tokens; one run per width, "
                "binary search).", "",
                *md_table(["batch", "layout", "width", "parameters", "peak growth MiB"], rows),
                f"Parameters against data parallelism: {ratios} (target >= 6).", ""]
    return out


def render_cp(d: dict) -> list[str]:
    m, mem = d["model"], d["memory"]
    shape = (f"Llama-shaped, {m['n_layer']} layers, width {m['n_embd']}, "
             f"{m['n_head']}/{m['n_kv_head']} query/key-value heads, vocabulary "
             f"{m['vocab_size']}, {d['dtype']}, one sequence, one thread per rank")
    goals = d["goals"]
    rows = [[v, f["cp"], (">= " if f["at_limit"] else "") + str(f["longest"]),
             fmt(f["vs_cp1"]), fmt(goals["combined"] if "+" in v
                                   else goals["memory_ratio"] * f["cp"])]
            for v, f in mem["by_variant"].items()]
    out = [f"A. Longest sequence whose training step (forward and backward) stays under "
           f"{fmt(mem['cap_bytes'] / MiB)} MiB of peak memory growth on every rank (cp = 1's "
           f"peak at {mem['cap_t']} tokens), in steps of {mem['search_step']} tokens up to "
           f"{mem['max_t']}; {shape}; recompute = `--model.recompute=block`, chunked = "
           f"`--model.loss_chunk={d['loss_chunk']}`.", "",
           *md_table(["variant", "cp", "longest T", "vs cp=1", "goal"], rows)]
    speed = [[cp, fmt_spread(r["step_s"]["ring"], 1e3),
              fmt_spread(r["step_s"]["allgather"], 1e3), fmt(r["speedup"]),
              fmt_spread(r["hidden_share"]) if r.get("hidden_share") else "n/a",
              fmt_spread(r["exposed_s"], 1e3), fmt_spread(r["alone_s"], 1e3)]
             for cp, r in d["speed"].items()]
    out += [f"B, C. Step time (forward and backward, ms, median [min, max] over "
            f"{d['repeats']} steps) at T = {d['speed_seq']} of ring attention against every "
            "rank all-gathering the whole sequence's keys and values (torch.distributed, "
            "gloo; torch's own context parallelism runs only CUDA attention kernels); "
            "speedup = all-gather / ring (goal >= "
            f"{fmt(goals['speedup'])}). Hidden share: the ring's transfers already complete "
            "when the compute posted beside them ended. Blocked: time in the ring's waits "
            "per step (slowest rank; includes waiting for a slower neighbour's compute); "
            "alone: the same transfers back to back with nothing between post and wait. "
            "2 cores shared by the ranks: times are an indication only.", "",
            *md_table(["cp", "ring ms", "all-gather ms", "speedup", "hidden share",
                       "blocked ms", "transfers alone ms"], speed)]
    return out
