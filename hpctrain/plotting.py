"""Figures drawn to PNG files with matplotlib's Agg backend (no display: login nodes,
CI, a job's node). Shared by the study report and the run report."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend, imported only when a report draws."""
    import matplotlib  # heavy: only when something is plotted

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, outside: bool = False) -> Path:
    """Write ``fig`` to ``path`` (its folder made if missing) and free it. ``outside``:
    the image grows to hold what lies outside the axes (a legend below them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight" if outside else None)
    pyplot().close(fig)
    return path
