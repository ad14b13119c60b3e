"""The section of perf/RESULTS.md for preparing corpora (``perf/bench_prepare.py``;
``perf/make_results.py`` puts it in order)."""

from __future__ import annotations

from perf.common import fmt, fmt_spread
from perf.results_format import md_table
from hpctrain.sizes import MiB


def render_prepare(d: dict) -> list[str]:
    rows = []
    for c in d["configs"].values():
        rounds = c["rounds"]
        ours = [c["tokens"] / r["seconds"] for r in rounds["hpctrain"]]
        pool = [c["tokens"] / r["seconds"] for r in rounds["pool"]]
        rows.append([c["format"], c["processes"], fmt_spread(ours, 1e-6), fmt_spread(pool, 1e-6),
                     fmt(c["ratio"]),
                     fmt(c["hpctrain_tokens_per_cpu_s"] / c["pool_tokens_per_cpu_s"]),
                     fmt(c["hpctrain_peak_rss_per_rank"] / MiB),
                     fmt(c["hpctrain_rss_growth_per_rank"] / MiB),
                     fmt(c["pool_parent_peak_rss"] / MiB),
                     fmt(c["pool_worker_peak_rss"] / MiB)])
    mb = d["text_bytes"] / 1e6
    return [f"`hpctrain prepare --tokenizer gpt2` against a process pool tokenizing the way "
            f"nanoGPT's fineweb.py does, on the same cores: {d['documents']:,} documents "
            f"({fmt(mb)} MB of the standard library's sources) as Parquet and as JSON lines; "
            "million tokens/s, median [min, max] over interleaved rounds; ratio = hpctrain / "
            "pool (medians); per CPU s = the same ratio of tokens per CPU second; peak RSS "
            "in MiB (growth: over the process before the work).", "",
            *md_table(["format", "processes", "hpctrain prepare", "process pool",
                       "ratio", "per CPU s", "peak RSS/rank", "growth/rank", "pool parent",
                       "pool worker"], rows),
            f"Goal: ratio >= {fmt(d['goal'])} in every configuration (worst "
            f"{fmt(d['worst_ratio'])}x) -> {'met' if d.get('met') else 'missed'}.", ""]
