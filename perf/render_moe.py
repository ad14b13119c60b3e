"""The section of perf/RESULTS.md for mixtures of experts (``perf/bench_moe.py``)."""

from __future__ import annotations

from perf.common import fmt, fmt_spread
from perf.results_format import md_table


def render_moe(d: dict) -> list[str]:
    rows = [[ep, fmt_spread(r["hpctrain"], 1e3), fmt_spread(r["torch"], 1e3),
             fmt(r["speedup"])] for ep, r in d["dispatch"].items()]
    out = [f"A. Dispatch and combine of {d['tokens_per_rank']} tokens per rank, each to "
           f"top-{d['top_k']} of {d['experts']} experts chosen at random, width "
           f"{d['width']}, fp32 (ms, median [min, max], slowest rank): hpctrain "
           "(counts by `MPI_Ialltoall`, rows by `MPI_Ialltoallv`) against the same steps "
           "with torch.distributed `all_to_all_single` over gloo; speedup = torch / "
           "hpctrain (goal >= 1.0).", "",
           *md_table(["ep", "hpctrain ms", "torch ms", "speedup"], rows)]
    m = d["step_model"]
    rows = []
    for ep, r in d["step"].items():
        rows.append([ep, fmt(r["tokens_per_s_ratio"]), f"{r['hpctrain']['params_per_rank']:,}",
                     f"{r['ddp']['params_per_rank']:,}", fmt(r["params_ratio"])])
    out += [f"B. A training step of a Llama-shaped MoE ({m['n_layer']} layers, width "
            f"{m['n_embd']}, {m['moe_experts']} experts of width {m['moe_ffn_hidden']}, "
            f"top-{m['moe_top_k']}) on tiny Shakespeare: hpctrain with `--parallel.ep` "
            "against torch DDP (gloo) with every expert on every rank, same ranks, data and "
            "AdamW; tokens/s ratio = hpctrain / DDP (medians after warm-up). 2 cores shared "
            "by the ranks: an indication only.", "",
            *md_table(["ep", "tokens/s ratio", "params/rank hpctrain", "params/rank DDP",
                       "params ratio"], rows)]
    b = d["balance"]
    rows = [[coef, fmt(r["imbalance"]["median"]), fmt(r["imbalance"]["min"]),
             fmt(r["imbalance"]["max"]), fmt(r["final_loss"])]
            for coef, r in b["by_coefficient"].items()]
    out += [f"C. Load balance after {b['steps']} steps of tiny Shakespeare in one process: "
            "the busiest expert's share over the mean (1 = even; "
            f"{m['moe_experts'] // m['moe_top_k']} = every copy on {m['moe_top_k']} experts), "
            f"worst layer, over the last {b['tail']} logged steps; only the balancing "
            "loss's coefficient differs.", "",
            *md_table(["coefficient", "imbalance median", "min", "max", "final loss"], rows)]
    g = d["grouped"]
    out += ["D. Forward and backward of the experts on their routed copies (ms): one "
            "`grouped_mm` against a loop over experts (one thread).", "",
            *md_table(["grouped_mm", "loop", "loop / grouped"],
                      [[fmt_spread(g["grouped"], 1e3), fmt_spread(g["loop"], 1e3),
                        fmt(g["loop_over_grouped"])]])]
    return out
