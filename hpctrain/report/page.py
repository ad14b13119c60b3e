"""Write a report: the PNGs into ``OUT/plots/`` and ``OUT/report.html`` with every image
embedded (one file: it opens offline and can be mailed or copied anywhere). Only these
files are written; nothing else in OUT is touched."""

from __future__ import annotations

from pathlib import Path

from hpctrain.atomic import WRITE_ERRORS, temporary_file, write_failed
from hpctrain.errors import UserError
from hpctrain.markdown_html import to_html
from hpctrain.report import plots
from hpctrain.report.expert_plots import expert_load, has_expert_load
from hpctrain.report.runs import Run, read_run
from hpctrain.report.trace_summary import phase_text, trace_line

PAGE = "report.html"


def _f(x, fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def run_table(runs: list[Run]) -> tuple[list, list]:
    headers = ["run", "status", "last step", "segments", "last loss", "whole-split val loss",
               "tokens/s (last)", "step ms (median)", "folder"]
    rows = []
    for run in runs:
        last = run.records[-1] if run.records else {}
        s = run.summary or {}
        status = s.get("status") or "running or stopped (no summary.json)"
        rows.append([run.label, status, last.get("step", "-"), run.segments,
                     _f(last.get("loss")), _f((run.final or {}).get("final_val_loss")),
                     _f(last.get("tokens_per_s"), "{:,.0f}"), _f(s.get("step_ms_median"),
                                                                 "{:.1f}"),
                     f"`{run.path}`"])
    return headers, rows


def _images(runs: list[Run], plot_dir: Path) -> list[tuple]:
    """Draw each plot; return the page's blocks for them (a note where the runs hold
    nothing for a plot yet)."""
    blocks = [("h2", "Loss"),
              ("img", plots.loss(runs, plot_dir / "loss_step.png", "step"), "loss vs step"),
              ("img", plots.loss(runs, plot_dir / "loss_time.png", "wall_s"), "loss vs time"),
              ("h2", "Throughput and MFU"),
              ("img", plots.throughput(runs, plot_dir / "throughput.png"), "throughput")]
    no_mfu = [r.label for r in runs if r.records and not plots.has_mfu(r)]
    if no_mfu:
        blocks.append(("p", f"No MFU for {'; '.join(no_mfu)}: the device's peak is unknown "
                            "(CPUs have none); `--train.peak_tflops` sets it."))
    if any(has_expert_load(r) for r in runs):
        blocks += [("h2", "Expert load"),
                   ("p", "How the router spread each step's token copies over the experts "
                         "(`moe_load` in metrics.jsonl, summed over the ranks)."),
                   ("img", expert_load(runs, plot_dir / "expert_load.png"), "expert load")]
    finished = [r for r in runs if r.summary]
    blocks.append(("h2", "Step time by phase"))
    if any((r.summary.get("timing") or {}).get("phases_ms") for r in finished):
        blocks += [("p", "Median milliseconds of each phase of a step after warm-up, "
                         "averaged over the ranks (`summary.json` `timing.phases_ms`); "
                         "`backward` includes the time gradient hooks spend."),
                   ("img", plots.phases(runs, plot_dir / "phases.png"), "phases")]
    else:
        blocks.append(("p", "No `summary.json` with step phases yet: it is written when "
                            "a run finishes."))
    blocks.append(("h2", "Memory per rank"))
    if any(plots.memory_rows(r) for r in finished):
        blocks += [("p", "Model-state bytes of each rank by part (`memory_by_rank`) and "
                         "the process's peak resident memory."),
                   ("img", plots.memory(runs, plot_dir / "memory.png"), "memory")]
    else:
        blocks.append(("p", "No `summary.json` with memory yet: it is written when a run "
                            "finishes."))
    return blocks + trace_blocks(runs)


def trace_blocks(runs: list[Run]) -> list[tuple]:
    """A table per rank of each run traced with ``--train.profile``: its top kernels (or
    host operators on a CPU) over the traced steps, and how idle the device was."""
    traced = [r for r in runs if r.traces]
    if not traced:
        return []
    blocks = [("h2", "Trace"),
              ("p", "From each rank's `trace/rank<r>.json` (open one in "
                    "https://ui.perfetto.dev): busy is the union of the device's kernel "
                    "intervals (on a CPU run, of the host's outermost operators), span the "
                    "traced steps from first to last event, idle = 1 - busy / span; share "
                    "is of the summed kernel time.")]
    for run in traced:
        for rank, s in run.traces.items():
            what = "kernel" if s["source"] == "device" else "host operator (CPU trace)"
            blocks += [("p", f"{run.label}, rank {rank}: {s['steps']} step(s), span "
                             f"{s['span_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms, idle "
                             f"{100 * s['idle_share']:.1f}%"
                             + (f"; per step, phase ranges: {phase_text(s)}"
                                if s.get("phases_ms") else "")),
                       ("table", [what, "ms", "count", "share"],
                        [[f"`{t['name'][:80]}`", f"{t['ms']:.2f}", t["count"],
                          f"{100 * t['share']:.1f}%"] for t in s["top"]])]
    return blocks


def build_report(run_dirs: list[str | Path], out: str | Path | None = None,
                 log=None) -> Path:
    """Read the runs, draw, write the page; return its path. ``out`` defaults to
    ``RUN/report`` for one run and is required for several. ``log``: prints a line per
    traced rank (``hpctrain report``'s output)."""
    if not run_dirs:
        raise UserError("name at least one run directory (a --train.out_dir)")
    runs = [read_run(d) for d in run_dirs]
    for run in runs:
        for rank, s in run.traces.items():
            if log is not None:
                log(f"{run.label}: {trace_line(rank, s)}")
    if out is None:
        if len(runs) > 1:
            raise UserError("several runs: name the folder for their report with --out DIR")
        out = runs[0].path / "report"
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the report folder {out}: {e}; pass another --out") \
            from None
    try:
        images = _images(runs, out / "plots")
    except WRITE_ERRORS as e:  # a full disk or quota while drawing
        raise write_failed(out / "plots", e) from None
    blocks = [("h1", "Training report"), ("table", *run_table(runs)), *images]
    notes = [n for r in runs for n in r.notes]
    if notes:
        blocks += [("h2", "Notes"), ("list", notes)]
    blocks = [("img", str(Path(b[1]).relative_to(out)), b[2]) if b[0] == "img" else b
              for b in blocks]
    page = out / PAGE
    with temporary_file(page) as tmp:  # whole or not at all; an earlier page stays
        tmp.write_text(to_html(blocks, "hpctrain report", embed_from=out))
    return page
