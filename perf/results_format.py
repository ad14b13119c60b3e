"""What every section of perf/RESULTS.md shares: markdown tables, medians and ratios of
raw values that may be missing, and the provenance line of a result."""

from __future__ import annotations

import statistics

from perf.common import fmt, table_lines


def md_table(columns: list[str], rows: list[list]) -> list[str]:
    return [*table_lines(columns, rows, markdown=True), ""]


def median_of(values):
    values = [v for v in values or [] if v is not None]
    return statistics.median(values) if values else None


def ratio_of(a, b):
    return a / b if a is not None and b else None


def provenance(d: dict) -> str:
    """One line: commit, tree state, date, machine, duration."""
    clean = d.get("tree_clean")
    tree = {True: "yes", False: "**no**"}.get(clean, "unknown")
    m = d.get("machine", {})
    cpu = f"{m.get('cpus', '?')} CPUs" + (f" ({m['cpu_model']})" if m.get("cpu_model") else "")
    cuda = ", CUDA" if m.get("cuda") else ""
    took = f"{fmt(d['duration_s'] / 60)} min" if d.get("duration_s") is not None else "unknown"
    line = (f"Commit `{d.get('git_sha', 'unknown')}`, tree clean: {tree}; run "
            f"{d.get('time', 'unknown').replace('T', ' ')}; machine: {cpu}, "
            f"{m.get('platform', 'unknown')}, Python {m.get('python', '?')}, torch "
            f"{m.get('torch', '?')}{cuda}; duration: {took}.")
    if clean is False:
        line += (" Run from a tree with uncommitted changes (" +
                 ", ".join(f"`{p}`" for p in d.get("dirty_paths", [])[:5]) + ").")
    if d.get("quick"):
        line += " **A --quick smoke test, not a result to quote.**"
    return line
