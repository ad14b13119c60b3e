"""The run report's figures, one PNG each; several runs share the axes, each run in its
own colour, line style and marker (``run_style``), so runs whose curves coincide (the same
losses at 1 and 2 ranks) stay visible, and the legend sits outside the axes, over no
data."""

from __future__ import annotations

from pathlib import Path

from hpctrain.plotting import pyplot, save_figure
from hpctrain.report.runs import Run
from hpctrain.sizes import MiB

STACKED_PHASES = ("data", "forward", "backward", "wait", "optimizer", "bubble", "other")
"""``timing.phases_ms`` without ``hooks`` (a part of ``backward``) and ``step`` (their
sum): the stacked bars add up to the step."""
MEMORY_PARTS = ("params", "grads", "optimizer", "comm_buffers")


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
"""Run ``i`` draws with ``LINE_STYLES[i % 4]`` and ``MARKERS[i % 7]``: 4 and 7 share no
factor, so 28 runs have 28 different pairs."""
MARKS_PER_LINE = 8


def run_style(index: int) -> dict:
    """The line style and marker of the ``index``-th run of a plot."""
    return {"linestyle": LINE_STYLES[index % len(LINE_STYLES)],
            "marker": MARKERS[index % len(MARKERS)], "markersize": 4}


def _legend(ax) -> None:
    """Outside the axes, on their right: it covers no curve however many runs there are
    (the figures are wide enough for it beside the axes)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0)


def _line(ax, records: list[dict], x: str, y: str, index: int = 0, runs: int = 1,
          **style):
    """``y`` against ``x``, broken between the segments of a resumed run (the time
    between them is not on the clock); returns the first piece's line. Markers go on
    about ``MARKS_PER_LINE`` points (every ``runs``-th at most), shifted by the run's
    ``index`` of ``runs``: coinciding curves show each run's markers on other points."""
    first = None
    for seg in sorted({r["segment"] for r in records}):
        piece = [r for r in records if r["segment"] == seg and r.get(y) is not None]
        if not piece:
            continue
        every = max(runs, len(piece) // MARKS_PER_LINE)
        line, = ax.plot([r[x] for r in piece], [r[y] for r in piece],
                        markevery=(index * every // runs, every), **style)
        if first is None:
            first = line
            style = {**style, "color": line.get_color(), "label": None}
    return first


def _loss(runs: list[Run], ax, x: str) -> None:
    """Training loss as lines, validation estimates as hollow markers, the whole-split
    validation loss as a star, each in the run's colour and style."""
    for i, run in enumerate(runs):
        style = run_style(i)
        line = _line(ax, run.records, x, "loss", i, len(runs), lw=1.2, label=run.label,
                     **style)
        if line is None:
            continue
        val = [r for r in run.records if r.get("val_loss") is not None]
        if val:
            ax.plot([r[x] for r in val], [r["val_loss"] for r in val], linestyle="none",
                    marker=style["marker"], ms=6, markerfacecolor="none",
                    color=line.get_color(), label=f"{run.label} (validation)")
        if run.final is not None and run.final.get("final_val_loss") is not None:
            ax.plot([run.final[x]], [run.final["final_val_loss"]], "*", ms=10,
                    color=line.get_color())
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    _legend(ax)


LOSS_AXES = {
    "step": ("step", "loss against step (star: the final evaluation)"),
    "wall_s": ("training time, s (segments of a resumed run joined)",
               "loss against wall-clock time"),
}
"""The loss plot's x field -> (axis label, title)."""


def draw_loss(runs: list[Run], x: str):
    """The loss figure against ``x``: ``step`` or ``wall_s`` (a key of ``LOSS_AXES``)."""
    fig, ax = pyplot().subplots(figsize=(10, 4.2))
    _loss(runs, ax, x)
    label, title = LOSS_AXES[x]
    ax.set_xlabel(label)
    ax.set_title(title)
    return fig


def loss(runs: list[Run], path: Path, x: str) -> Path:
    return save_figure(draw_loss(runs, x), path, outside=True)


def has_mfu(run: Run) -> bool:
    """Whether any of the run's records has an MFU (the device's peak was known)."""
    return any(r.get("mfu") is not None for r in run.records)


def draw_throughput(runs: list[Run]):
    """Tokens/s over training time, and MFU below it when some run has one (none on a
    CPU whose peak is unknown: then no empty panel; the page says why)."""
    with_mfu = any(has_mfu(run) for run in runs)
    fig, axes = pyplot().subplots(2 if with_mfu else 1, 1, figsize=(10, 5.5 if with_mfu
                                                                      else 3.2),
                                  sharex=True, squeeze=False)
    top = axes[0][0]
    for i, run in enumerate(runs):
        style = {"lw": 1.2, **run_style(i)}
        line = _line(top, run.records, "wall_s", "tokens_per_s", i, len(runs),
                     label=run.label, **style)
        if line is not None and with_mfu and has_mfu(run):
            mfu = [{**r, "mfu_pct": 100 * r["mfu"]} for r in run.records
                   if r.get("mfu") is not None]
            _line(axes[1][0], mfu, "wall_s", "mfu_pct", i, len(runs),
                  color=line.get_color(), label=run.label, **style)
    top.set_ylabel("tokens/s (all ranks)")
    top.set_title("throughput and model FLOP utilization" if with_mfu else "throughput")
    if with_mfu:
        axes[1][0].set_ylabel("MFU, %")
    axes[-1][0].set_xlabel("training time, s")
    for (ax,) in axes:
        ax.grid(True, alpha=0.3)
        _legend(ax)
    return fig


def throughput(runs: list[Run], path: Path) -> Path:
    return save_figure(draw_throughput(runs), path, outside=True)


def phases(runs: list[Run], path: Path) -> Path:
    """One stacked bar per run: the median milliseconds of each phase of a step."""
    timed = [(run.label, run.summary["timing"]["phases_ms"]) for run in runs
             if (run.summary or {}).get("timing", {}).get("phases_ms")]
    fig, ax = pyplot().subplots(figsize=(8, 0.45 * len(timed) + 1.8))
    left = [0.0] * len(timed)
    for phase in STACKED_PHASES:
        widths = [ms.get(phase, 0.0) for _, ms in timed]
        ax.barh([label for label, _ in timed], widths, left=left, label=phase)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median after warm-up, averaged over ranks)")
    ax.set_title("where a step's time goes")
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, ncol=len(STACKED_PHASES), loc="upper center",
              bbox_to_anchor=(0.5, -0.12 - 0.5 / (len(timed) + 1)))
    return save_figure(fig, path, outside=True)


def memory_rows(run: Run) -> list[tuple[str, dict]]:
    """(rank, bytes by part with ``peak_rss_bytes``) from the summary: every rank's
    (``memory_by_rank``), or rank 0's model state with the largest rank's peak for a
    summary that has only those."""
    s = run.summary or {}
    if s.get("memory_by_rank"):
        return [(str(i), row) for i, row in enumerate(s["memory_by_rank"])]
    if s.get("memory_per_rank"):
        return [("0", {**s["memory_per_rank"],
                       "peak_rss_bytes": s.get("peak_rss_bytes_max_rank", 0)})]
    return []


def draw_memory(runs: list[Run]):
    """One column per run: model-state MiB of each rank stacked by part (top), and each
    rank's peak resident memory (bottom; the process, torch and MPI included); one legend
    of the parts, right of the last column."""
    shown = [(run.label, rows) for run in runs if (rows := memory_rows(run))]
    n = max(1, len(shown))
    fig, axes = pyplot().subplots(2, n, figsize=(3.6 * n + 1, 5.5), squeeze=False)
    for col, (label, rows) in enumerate(shown):
        state, rss = axes[0][col], axes[1][col]
        ranks = [rank for rank, _ in rows]
        bottom = [0.0] * len(rows)
        for part in MEMORY_PARTS:
            heights = [row.get(part, 0) / MiB for _, row in rows]
            state.bar(ranks, heights, bottom=bottom, label=part)
            bottom = [a + b for a, b in zip(bottom, heights)]
        rss.bar(ranks, [row.get("peak_rss_bytes", 0) / MiB for _, row in rows], color="0.5")
        state.set_title(label, fontsize=8)
        state.set_ylabel("model state, MiB")
        rss.set_ylabel("peak RSS, MiB")
        rss.set_xlabel("rank")
    _legend(axes[0][-1])
    fig.suptitle("memory per rank", fontsize=10)
    return fig


def memory(runs: list[Run], path: Path) -> Path:
    return save_figure(draw_memory(runs), path, outside=True)
