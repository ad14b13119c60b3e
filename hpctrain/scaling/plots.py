"""PNG plots of a study (matplotlib, Agg backend: no display needed on a login node)."""

from __future__ import annotations

from pathlib import Path

from hpctrain.plotting import pyplot, save_figure
from hpctrain.scaling.analysis import TOLERANCE, PointResult, efficiency, ideal_throughput

COMPONENTS = ("compute", "comm", "bubble", "data")
COLORS = {"compute": "#4C72B0", "comm": "#DD8452", "bubble": "#C44E52", "data": "#55A868"}


def throughput(groups: dict[str, list[PointResult]], path: Path, title: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, pts) in enumerate(groups.items()):
        ok = [p for p in pts if p.ok]
        if not ok:
            continue
        line, = ax.plot([p.ranks for p in ok], [p.tokens_per_s for p in ok], "o-", label=name)
        ideal = ideal_throughput(pts)
        ax.plot(list(ideal), list(ideal.values()), "--", color=line.get_color(), alpha=0.5,
                label="ideal" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def efficiency_plot(groups: dict[str, list[PointResult]], scaling: str, path: Path,
                    title: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in groups.items():
        eff = efficiency(pts, scaling)
        if eff:
            ax.plot(list(eff), list(eff.values()), "o-", label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel(f"{scaling} scaling efficiency")
    ax.set_ylim(0, 1.2)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return save_figure(fig, path)


def breakdown(points: list[PointResult], path: Path, title: str) -> Path:
    """Stacked step time per point: the trainer's shares times its median step."""
    plt = pyplot()
    ok = [p for p in points if p.ok]
    fig, ax = plt.subplots(figsize=(7, 0.28 * len(ok) + 1.5))
    labels = [p.point for p in ok]
    left = [0.0] * len(ok)
    for comp in COMPONENTS:
        widths = [p.step_ms * (p.shares.get(comp) or 0.0) for p in ok]
        ax.barh(labels, widths, left=left, color=COLORS[comp], label=comp)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("step time, ms (median after warm-up)")
    ax.set_title(title)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path)


def prediction(points: list[PointResult], path: Path, title: str) -> Path:
    plt = pyplot()
    ok = [p for p in points if p.error is not None]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    xs, ys = [p.step_ms for p in ok], [p.predicted_ms for p in ok]
    hi = max(xs + ys) * 1.15 if ok else 1.0
    ax.fill_between([0, hi], [0, hi * (1 - TOLERANCE)], [0, hi * (1 + TOLERANCE)],
                    color="#ddd", label=f"within {TOLERANCE:.0%}")
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    for r in sorted({p.ranks for p in ok}):
        sel = [p for p in ok if p.ranks == r]
        ax.plot([p.step_ms for p in sel], [p.predicted_ms for p in sel], "o",
                label=f"{r} rank(s)")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured step, ms")
    ax.set_ylabel("predicted step, ms")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return save_figure(fig, path)

