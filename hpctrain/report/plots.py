"""The run report's figures, one PNG each; several runs share the axes, one colour per
run (its label in the legend)."""

from __future__ import annotations

from pathlib import Path

from hpctrain.plotting import pyplot, save_figure
from hpctrain.report.runs import Run
from hpctrain.sizes import MiB

STACKED_PHASES = ("data", "forward", "backward", "wait", "optimizer", "bubble", "other")
"""``timing.phases_ms`` without ``hooks`` (a part of ``backward``) and ``step`` (their
sum): the stacked bars add up to the step."""
MEMORY_PARTS = ("params", "grads", "optimizer", "comm_buffers")


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _line(ax, records: list[dict], x: str, y: str, **style):
    """``y`` against ``x``, broken between the segments of a resumed run (the time
    between them is not on the clock); returns the first piece's line."""
    first = None
    for seg in sorted({r["segment"] for r in records}):
        piece = [r for r in records if r["segment"] == seg and r.get(y) is not None]
        if not piece:
            continue
        line, = ax.plot([r[x] for r in piece], [r[y] for r in piece], **style)
        if first is None:
            first = line
            style = {**style, "color": line.get_color(), "label": None}
    return first


def _loss(runs: list[Run], ax, x: str) -> None:
    """Training loss as lines, validation estimates as dots, the whole-split validation
    loss as a star, each in the run's colour."""
    for run in runs:
        line = _line(ax, run.records, x, "loss", lw=1.2, label=run.label)
        if line is None:
            continue
        val = [r for r in run.records if r.get("val_loss") is not None]
        if val:
            ax.plot([r[x] for r in val], [r["val_loss"] for r in val], "o--", ms=4,
                    color=line.get_color(), alpha=0.8, label=f"{run.label} (validation)")
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


def loss(runs: list[Run], path: Path, x: str) -> Path:
    """Loss against ``x``: ``step`` or ``wall_s`` (a key of ``LOSS_AXES``)."""
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    _loss(runs, ax, x)
    label, title = LOSS_AXES[x]
    ax.set_xlabel(label)
    ax.set_title(title)
    return save_figure(fig, path)


def throughput(runs: list[Run], path: Path) -> Path:
    """Tokens/s and MFU over training time, one panel each."""
    fig, (top, bottom) = pyplot().subplots(2, 1, figsize=(7, 5.5), sharex=True)
    no_mfu = []
    for run in runs:
        line = _line(top, run.records, "wall_s", "tokens_per_s", lw=1.2, label=run.label)
        if line is None:
            continue
        mfu = [{**r, "mfu_pct": 100 * r["mfu"]} for r in run.records
               if r.get("mfu") is not None]
        if mfu:
            _line(bottom, mfu, "wall_s", "mfu_pct", lw=1.2, color=line.get_color(),
                  label=run.label)
        else:
            no_mfu.append(run.path.name)
    top.set_ylabel("tokens/s (all ranks)")
    top.set_title("throughput and model FLOP utilization")
    bottom.set_ylabel("MFU, %")
    bottom.set_xlabel("training time, s")
    if no_mfu:
        bottom.text(0.01, 0.95, f"no MFU in {', '.join(no_mfu)}: the device's peak is "
                    "unknown (--train.peak_tflops sets it)", transform=bottom.transAxes,
                    fontsize=7, va="top", wrap=True)
    for ax in (top, bottom):
        ax.grid(True, alpha=0.3)
        _legend(ax)
    return save_figure(fig, path)


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


def memory(runs: list[Run], path: Path) -> Path:
    """One column per run: model-state MiB of each rank stacked by part (top), and each
    rank's peak resident memory (bottom; the process, torch and MPI included)."""
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
        state.legend(fontsize=7)
    fig.suptitle("memory per rank", fontsize=10)
    return save_figure(fig, path)
