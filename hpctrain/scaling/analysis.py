"""From records to numbers: per-point medians over repeats, scaling efficiency, and the
model's prediction error (pure functions; the report and the tests use them).

Efficiency as ALCF and the scaling literature define it, N0 the
smallest rank count of a series:

    weak   E(N) = tok/s(N) / ((N / N0) tok/s(N0))      fixed batch per device
    strong E(N) = T(N0) N0 / (T(N) N)                  fixed global batch
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

TOLERANCE = 0.25
"""The validation target: predictions within +-25% of the measured step time."""


@dataclass
class PointResult:
    point: str
    index: int
    series: str
    config: dict
    runs: int
    failed: int
    step_ms: float | None = None
    """Median over repeats of each run's median step time."""
    step_ms_p90: float | None = None
    tokens_per_s: float | None = None
    tokens_per_s_per_rank: float | None = None
    tflops_per_rank: float | None = None
    mfu: float | None = None
    shares: dict = field(default_factory=dict)
    peak_rss: float | None = None
    prediction: dict | None = None
    errors: list = field(default_factory=list)
    background: float | None = None
    """Most cores other processes kept busy before any of this point's runs."""

    @property
    def ranks(self) -> int:
        return int(self.config["ranks"])

    @property
    def ok(self) -> bool:
        return self.step_ms is not None

    @property
    def predicted_ms(self) -> float | None:
        return self.prediction["step_s"] * 1e3 if self.prediction else None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        if not self.ok or self.predicted_ms is None:
            return None
        return self.predicted_ms / self.step_ms - 1.0


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def aggregate(records: list[dict]) -> list[PointResult]:
    """One result per point, in study order; repeats reduce to medians."""
    by_point: dict[str, list[dict]] = {}
    for r in records:
        by_point.setdefault(r["point"], []).append(r)
    out = []
    for pid, recs in by_point.items():
        ok = [r for r in recs if r["status"] == "ok" and r.get("measured")]
        first = recs[0]
        res = PointResult(point=pid, index=first.get("index", 0), series=first["series"],
                          config=first["config"], runs=len(recs), failed=len(recs) - len(ok),
                          prediction=first.get("prediction"),
                          errors=[r["error"] for r in recs if r["status"] != "ok"])
        busy = [r.get("background_busy_cores") for r in recs]
        res.background = max((b for b in busy if b is not None), default=None)
        if ok:
            m = [r["measured"] for r in ok]
            res.step_ms = _median(x["step_ms_median"] for x in m)
            res.step_ms_p90 = _median(x["step_ms_p90"] for x in m)
            res.tokens_per_s = _median(x["tokens_per_s"] for x in m)
            res.tokens_per_s_per_rank = _median(x["tokens_per_s_per_rank"] for x in m)
            res.tflops_per_rank = _median(x["tflops_per_rank"] for x in m)
            res.mfu = _median(x["mfu"] for x in m)
            res.peak_rss = _median(x["peak_rss_bytes_max_rank"] for x in m)
            keys = set().union(*[(x.get("shares") or {}).keys() for x in m])
            res.shares = {k: _median((x.get("shares") or {}).get(k) for x in m) for k in keys}
        out.append(res)
    return sorted(out, key=lambda p: (p.index, p.ranks))


def series(points: list[PointResult]) -> dict[str, list[PointResult]]:
    """Points that differ only in rank count, by series name, sorted by ranks."""
    out: dict[str, list[PointResult]] = {}
    for p in points:
        out.setdefault(p.series, []).append(p)
    return {k: sorted(v, key=lambda p: p.ranks) for k, v in out.items()}


def efficiency(points: list[PointResult], scaling: str) -> dict[int, float]:
    """Scaling efficiency of one series by rank count, relative to its smallest ok point."""
    ok = [p for p in points if p.ok]
    if not ok:
        return {}
    base = ok[0]
    out = {}
    for p in ok:
        ratio = p.ranks / base.ranks
        if scaling == "weak":
            out[p.ranks] = p.tokens_per_s / (ratio * base.tokens_per_s)
        else:
            out[p.ranks] = base.step_ms * base.ranks / (p.step_ms * p.ranks)
    return out


def ideal_throughput(points: list[PointResult]) -> dict[int, float]:
    """Linear scaling from the smallest ok point (the dashed line of the plot)."""
    ok = [p for p in points if p.ok]
    if not ok:
        return {}
    base = ok[0]
    return {p.ranks: base.tokens_per_s * p.ranks / base.ranks for p in points}


def prediction_summary(points: list[PointResult], tolerance: float = TOLERANCE) -> dict:
    errs = [p.error for p in points if p.error is not None]
    return {"points": len(errs), "within": sum(abs(e) <= tolerance for e in errs),
            "max_abs": max((abs(e) for e in errs), default=None),
            "mean_abs": statistics.mean(abs(e) for e in errs) if errs else None,
            "tolerance": tolerance}
