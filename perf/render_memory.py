"""The sections of perf/RESULTS.md about memory: long context, one rank's peak memory and
activation recomputation (``perf/make_results.py`` puts them in order)."""

from __future__ import annotations

from perf.common import fmt, fmt_spread
from perf.results_format import md_table, ratio_of
from hpctrain.sizes import GiB, MiB


def render_long_context(d: dict) -> list[str]:
    m = d["model"]
    variants = list(dict.fromkeys(r["variant"] for r in d["sweep"]))
    by_seq: dict = {}
    for r in d["sweep"]:
        by_seq.setdefault(r["seq"], {})[r["variant"]] = r
    rows = []
    for seq, rs in by_seq.items():
        plain = rs.get("plain", {}).get("peak_bytes")
        row = [seq]
        for v in variants:
            r = rs.get(v)
            row += [fmt(r["peak_bytes"] / MiB), fmt_spread(r["step_ms_all"])] if r \
                else ["n/a", "n/a"]
        row += [fmt(ratio_of(plain, rs[v]["peak_bytes"])) if v in rs else "n/a"
                for v in variants[1:]]
        rows.append(row)
    shape = (f"Llama-shaped, {m['n_layer']} layers, width {m['n_embd']}, "
             f"{m['n_head']}/{m['n_kv_head']} query/key-value heads, vocabulary "
             f"{m['vocab_size']}, {'tied' if m.get('tie_embeddings', True) else 'untied'} "
             f"head, {d['dtype']}, one sequence, {d['threads']} threads")
    out = [f"Peak memory growth of one training step (forward and backward; MiB) and step "
           f"time (ms, median [min, max]) by sequence length T; {shape}; loss_chunk "
           f"{d['loss_chunk']}. Memory is the result; the times come from a shared, "
           "noisy machine and are an indication only.", "",
           *md_table(["T", *(f"{v} {k}" for v in variants for k in ("MiB", "ms")),
                    *(f"plain / {v} peak" for v in variants[1:])], rows)]
    cap = d.get("capacity", {})
    found = cap.get("by_variant", {})
    if found:
        out += [f"Longest sequence whose step stays under {fmt(cap['cap_bytes'] / MiB)} "
                f"MiB ({cap['cap_from']}), in steps of {cap['search_step']} tokens up to "
                f"{cap['max_t']}.", "",
                *md_table(["variant", "longest T", "vs plain"],
                        [[v, (">= " if f["at_limit"] else "") + str(f["longest"]),
                          fmt(f["vs_plain"])] for v, f in found.items()]),
                f"Target: the chunked head trains >= {fmt(d['target'])}x the plain head's "
                f"context under the same memory: {fmt(d['ratio'])}x -> "
                f"{'met' if d.get('met') else 'missed'}.", ""]
    return out


def render_memory(d: dict) -> list[str]:
    m = d["shape"]
    rows = [[r["variant"], "whole" if r["head_chunk"] in (None, 0) else f"{r['head_chunk']} tokens",
             fmt(r["state_bytes"] / GiB), fmt(r["step_peak_bytes"] / GiB),
             fmt(r["optimizer_peak_bytes"] / GiB), fmt(r["peak_bytes"] / GiB),
             fmt(r["formula"]["peak_bytes"] / GiB), fmt(r["vs_reference"]),
             fmt(r["step_vs_reference"]), fmt(r["vs_formula"]), fmt(r["step_vs_formula"])]
            for r in d["variants"]]
    pub = d["published"]
    return [f"Peak memory of one rank (GiB) training a GPT-2-medium-shaped model: "
            f"{m['n_layer']} layers, width {m['n_embd']}, {m['n_head']} heads, vocabulary "
            f"{m['vocab_size']}, {d['rows']} x {m['block_size']} tokens, {d['dtype']}, AdamW; "
            "`reference` is a plain torch GPT of the same shape (full logits, "
            "`F.cross_entropy`), `whole` hpctrain with `--model.loss_chunk=-1`, `default` "
            "hpctrain as it comes (automatic head). state: model, gradients, moments; step: "
            "the forward and backward's peak over the state; peak: state + the larger of "
            "step and optimizer step.", "",
            *md_table(["variant", "head", "state", "step", "optimizer", "peak",
                       "formula peak", "peak / reference", "step / reference",
                       "peak / formula", "step / formula"], rows),
            f"The formula's logits term at llm-foundry's MPT-350M micro-batch ({pub['rows']} "
            f"x {m['block_size']} tokens): {fmt(pub['whole_bytes'] / GiB)} GiB whole, "
            f"{fmt(pub['default_bytes'] / GiB)} GiB with the automatic head.", ""]
def render_recompute(d: dict) -> list[str]:
    out = [f"Activations kept for backward by the blocks' forward (MiB: measured, and the "
           f"formula of `hpctrain/scaling/activations.py`), their ratio to none's, the whole "
           f"model's (embedding and head included), and the forward + backward step time "
           f"(s, median [min, max] over {d['repeats']} steps; ratio of the medians and of the "
           f"fastest steps, and the FLOP count's prediction); {d['shape']['n_layer']} layers, width "
           f"{d['shape']['n_embd']}, T={d['T']}, {d['rows']} sequences, {d['dtype']}, "
           f"{d['threads']} thread. The step times come from a shared machine.", ""]
    for arch, rows in d["results"].items():
        out += [f"{arch}:", "",
                *md_table(["mode", "kept MiB", "formula MiB", "kept / none", "formula / none",
                           "model kept / none", "step s", "time / none", "min / min",
                           "predicted time"],
                          [[mode, fmt(r["kept_blocks"] / MiB), fmt(r["predicted_blocks"] / MiB),
                            fmt(r["kept_ratio"]), fmt(r["predicted_kept_ratio"]),
                            fmt(r["model_kept_ratio"]), fmt_spread(r["step_s_all"]),
                            fmt(r["time_ratio"]), fmt(r.get("time_ratio_min")),
                            fmt(r["predicted_time_ratio"])]
                           for mode, r in rows.items()]), ""]
    goal = d["goal"]
    out += [f"Goal: selective keeps <= {fmt(goal['kept'])} of none's activations at <= "
            f"{fmt(goal['time'])}x its step time: "
            + ", ".join(f"{a} {'met' if ok else 'missed'}" for a, ok in d["met"].items())
            + ".", ""]
    return out
