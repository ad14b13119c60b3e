"""``hpctrain scale report DIR``: DIR/report.md, DIR/report.html and DIR/plots/*.png.

Reads DIR/study.json (written when the study started) and DIR/records/*.json, so it can
run again at any time, also while a study is still going (it shows what has finished).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.markdown_html import to_html, to_markdown
from hpctrain.errors import UserError
from hpctrain.scaling import analysis, plots
from hpctrain.scaling.emit import collect
from hpctrain.scaling.records import read_records
from hpctrain.sizes import MiB

DEFINITIONS = [
    "**Weak-scaling efficiency** = tok/s(N) / ((N/N0) tok/s(N0)) at a fixed batch per "
    "data-parallel rank; **strong-scaling efficiency** = T(N0) N0 / (T(N) N) at a fixed "
    "global batch (N0: the smallest rank count of the series; T: step time).",
    "Step times are the trainer's median and 90th percentile after its warm-up steps; "
    "throughput is tokens per step / median step time.",
    "Shares come from the trainer's timers: **comm** is the wait for gradient reductions "
    "left after backward, **bubble** the pipeline's idle time, **data** the wait for the "
    "batch, **compute** the rest (ZeRO-3 gathers and the optimizer included).",
    "TFLOP/s per rank = FLOPs/token (6N + 12LCT) x tok/s / ranks; MFU divides by the "
    "system's peak per device (here: a one-thread matrix product, from calibration).",
]
BUSY_LIMIT = 0.3
"""Cores busy with other work above which a point's numbers are flagged."""


def _f(x, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _pct(x) -> str:
    return _f(None if x is None else 100 * x, "{:.1f}%")


def build_study_report(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if (folder / "jobs.json").is_file():  # per-point job scripts: gather finished runs
        collect(folder)
    meta_path = folder / "study.json"
    if not meta_path.is_file():
        raise UserError(f"{folder} holds no study (no study.json); give the --out folder of "
                        "`hpctrain scale run`")
    meta = json.loads(meta_path.read_text())
    recs = read_records(folder)
    if not recs:
        raise UserError(f"{folder}/records holds no records yet; run the study first")
    points = analysis.aggregate(recs)
    groups = analysis.series(points)
    scaling = meta["scaling"]
    name = meta["name"]
    pngs = {
        "throughput": plots.throughput(groups, folder / "plots" / "throughput.png",
                                       f"{name}: throughput vs ranks ({scaling} scaling)"),
        "efficiency": plots.efficiency_plot(groups, scaling, folder / "plots" / "efficiency.png",
                                            f"{name}: {scaling} scaling efficiency"),
        "breakdown": plots.breakdown(points, folder / "plots" / "breakdown.png",
                                     f"{name}: where the step time goes"),
    }
    if any(p.error is not None for p in points):
        pngs["prediction"] = plots.prediction(points, folder / "plots" / "prediction.png",
                                              f"{name}: predicted vs measured step time")
    blocks = build_blocks(meta, points, groups, {k: v.relative_to(folder) for k, v in pngs.items()})
    md = folder / "report.md"
    md.write_text(to_markdown(blocks))
    page = folder / "report.html"
    page.write_text(to_html(blocks, f"Scaling study {name}"))
    return [md, page, *pngs.values()]


def build_blocks(meta: dict, points: list, groups: dict, pngs: dict) -> list[tuple]:
    scaling = meta["scaling"]
    git = meta.get("git") or {}
    env = meta.get("environment") or {}
    b: list[tuple] = [("h1", f"Scaling study `{meta['name']}`")]
    if meta.get("description"):
        b.append(("p", meta["description"]))
    sha = (git.get("sha") or "unknown")[:12] + (" (with uncommitted changes)"
                                                if git.get("dirty") else "")
    b.append(("p", f"{scaling.capitalize()} scaling, {meta['steps']} steps per run, "
                   f"{meta['repeats']} repeat(s); started {meta.get('started')}; commit "
                   f"`{sha}`; {env.get('host')}: {env.get('cpu')}, {env.get('cores')} cores, "
                   f"torch {env.get('torch')}, {env.get('mpi')}; spec `{meta.get('spec')}`; "
                   f"system `{meta.get('system')}`"
                   + (f" calibrated by `{meta['calibration']}`" if meta.get("calibration")
                      else "") + "."))
    b += [("h2", "Definitions"), ("list", DEFINITIONS)]
    b += [("h2", "Measurements"), ("table", *measurement_table(points))]
    busy = [p for p in points if p.background is not None and p.background > BUSY_LIMIT]
    if busy:
        b.append(("p", f"**Shared machine**: other processes kept more than {BUSY_LIMIT} "
                       f"core(s) busy just before {len(busy)} point(s) ('busy' column); "
                       "their numbers include that interference."))
    b += [("h2", "Scaling"), ("table", *efficiency_table(groups, scaling)),
          ("img", str(pngs["throughput"]), "throughput vs ranks"),
          ("img", str(pngs["efficiency"]), "scaling efficiency"),
          ("h2", "Time breakdown"), ("img", str(pngs["breakdown"]), "time breakdown")]
    if "prediction" in pngs:
        s = analysis.prediction_summary(points)
        b += [("h2", "Performance model: predicted vs measured step time"),
              ("p", f"**{s['within']} of {s['points']}** points within "
                    f"+-{s['tolerance']:.0%}; largest error {_pct(s['max_abs'])}, mean "
                    f"absolute error {_pct(s['mean_abs'])}. Predictions were made before "
                    "each run from the calibration file (`hpctrain scale calibrate`: "
                    "forward+backward per model shape in one process, AdamW, collectives "
                    "under mpiexec), never from the study's own runs."),
              ("table", *error_table(points)),
              ("img", str(pngs["prediction"]), "predicted vs measured")]
    failed = [p for p in points if p.errors]
    if failed:
        b += [("h2", "Failed runs"),
              ("table", ["point", "failed / runs", "error"],
               [[p.point, f"{p.failed}/{p.runs}", p.errors[0]] for p in failed])]
    if meta.get("skipped"):
        b += [("h2", "Left out"), ("list", [f"{s['point']}: {s['reason']}"
                                            for s in meta["skipped"]])]
    return b


def measurement_table(points) -> tuple[list, list]:
    headers = ["point", "ranks", "dp", "pp", "tp", "zero", "micro", "rows/micro", "global batch",
               "step ms (p50)", "p90", "tok/s", "tok/s/rank", "TFLOP/s/rank", "MFU",
               "compute", "comm", "bubble", "data", "peak RSS MiB", "busy"]
    rows = []
    for p in points:
        c = p.config
        s = p.shares
        rows.append([p.point, c["ranks"], c["dp"], c["pp"], c.get("tp", 1), c["zero"],
                     c["micro_batches"],
                     c["micro_batch_rows"], c["global_batch"], _f(p.step_ms), _f(p.step_ms_p90),
                     _f(p.tokens_per_s, "{:,.0f}"), _f(p.tokens_per_s_per_rank, "{:,.0f}"),
                     _f(p.tflops_per_rank, "{:.4f}"), _pct(p.mfu),
                     *(_pct(s.get(k)) for k in ("compute", "comm", "bubble", "data")),
                     _f(None if p.peak_rss is None else p.peak_rss / MiB, "{:.0f}"),
                     _f(p.background, "{:.2f}")])
    return headers, rows


def efficiency_table(groups, scaling) -> tuple[list, list]:
    ranks = sorted({p.ranks for pts in groups.values() for p in pts})
    headers = ["series"] + [f"{r} rank(s): tok/s (eff.)" for r in ranks]
    rows = []
    for name, pts in groups.items():
        eff = analysis.efficiency(pts, scaling)
        by = {p.ranks: p for p in pts}
        rows.append([name] + [
            f"{by[r].tokens_per_s:,.0f} ({eff[r]:.2f})" if r in by and r in eff else "-"
            for r in ranks])
    return headers, rows


def error_table(points) -> tuple[list, list]:
    headers = ["point", "measured ms", "predicted ms", "error", "within 25%",
               "compute", "tp comm", "grad comm (exposed)", "ZeRO gathers", "optimizer",
               "bubble", "p2p", "ranks/core", "peak RSS MiB", "predicted MiB"]
    rows = []
    for p in points:
        if p.error is None:
            continue
        q = p.prediction
        ms = lambda k: _f(q[k] * 1e3)  # noqa: E731
        rows.append([p.point, _f(p.step_ms), _f(p.predicted_ms), f"{100 * p.error:+.1f}%",
                     "yes" if abs(p.error) <= analysis.TOLERANCE else "**no**",
                     ms("compute_s"), _f(q.get("tp_comm_s", 0.0) * 1e3), ms("grad_comm_s"), ms("gather_s"), ms("optimizer_s"),
                     ms("bubble_s"), ms("p2p_s"), _f(q["oversubscription"], "{:.1f}"),
                     _f(None if p.peak_rss is None else p.peak_rss / MiB, "{:.0f}"),
                     _f(q["memory_bytes"] / MiB, "{:.0f}")])
    return headers, rows
