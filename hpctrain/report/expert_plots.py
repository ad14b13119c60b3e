"""The run report's expert-load figure, for runs of a mixture of experts: how unevenly
the router spread the tokens (the busiest expert's load over the mean, per logged step)
and, for the last logged step of the first such run, each expert's share of each MoE
layer's token copies (``metrics.jsonl``'s ``moe_*`` keys, ``train/expert_load.py``)."""

from __future__ import annotations

from pathlib import Path

from hpctrain.plotting import pyplot, save_figure
from hpctrain.report.runs import Run


def has_expert_load(run: Run) -> bool:
    return any(r.get("moe_load") for r in run.records)


def expert_load(runs: list[Run], path: Path) -> Path:
    plt = pyplot()  # matplotlib is imported only when a report draws
    from matplotlib.ticker import MaxNLocator

    moe = [r for r in runs if has_expert_load(r)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for run in moe:
        steps = [r for r in run.records if r.get("moe_imbalance") is not None]
        left.plot([r["step"] for r in steps], [r["moe_imbalance"] for r in steps],
                  label=run.label, marker="o", markersize=3)
    left.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    left.set_xlabel("step")
    left.set_ylabel("busiest expert / mean (1 = even)")
    left.set_title("load imbalance, worst MoE layer")
    left.legend(fontsize=7)
    last = [r for r in moe[0].records if r.get("moe_load")][-1]
    shares = [[c / max(sum(row), 1e-12) for c in row] for row in last["moe_load"]]
    image = right.imshow(shares, aspect="auto", cmap="viridis", vmin=0.0)
    right.set_xlabel("expert")
    right.set_ylabel("MoE layer")
    right.set_title(f"each expert's share of the copies, step {last['step']}", fontsize=9)
    for axis in (right.xaxis, right.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))
    fig.colorbar(image, ax=right)
    return save_figure(fig, path)
