"""What a run's traces say (``--train.profile``: ``<run>/trace/rank<r>.json``, Chrome trace
JSON as torch's profiler exports it): per rank, where the time of the traced steps went.

- ``source``: ``device`` when the trace holds device work (events of category ``kernel``,
  ``gpu_memcpy``, ``gpu_memset``), else ``cpu``: the host's outermost operators
  (``cpu_op`` events not inside another on their thread), what a CPU run's time is.
- ``top``: those events grouped by name, longest first: total ``ms``, ``count``, and
  ``share`` of the summed time of them all.
- ``busy_ms``: the union of their intervals (two kernels that overlap, on two streams,
  count once); ``span_ms``: first to last event of the trace (the traced steps);
  ``idle_share``: 1 - busy / span, the time the device (or the host) did none of it.
- ``steps``: the ``ProfilerStep#N`` ranges, one per traced step.
- ``phases_ms``: milliseconds per traced step of each phase the phase clock bracketed
  (its ``phase:<name>`` ranges): on a device trace the device's busy time (union) of the
  kernels launched while the range was open, on any thread (``device_phase_us``); on a
  CPU trace the ranges' own length. ``hooks`` and ``weight`` lie inside ``backward``.
docs/design/gpu-timing.md says how to read them.
"""

from __future__ import annotations

import bisect
import json
import re
from pathlib import Path

from hpctrain.comm.phase_clock import ANNOTATION
from hpctrain.errors import UserError
from hpctrain.output_paths import RUN_TRACES as TRACE_DIR
from hpctrain.sizes import GiB

MAX_TRACE_BYTES = 2 * GiB
"""The largest trace read: parsed JSON takes several times its size in memory (a few
traced steps of a large model write hundreds of MiB per rank)."""
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
TOP = 10
_STEP = re.compile(r"ProfilerStep#\d+")
_RANK_FILE = re.compile(r"rank(\d{1,6})\.json")


def read_trace(path: str | Path, limit: int = MAX_TRACE_BYTES) -> list[dict]:
    """The complete events (``"ph": "X"``, with a start and a duration in µs) of the trace
    at ``path``; a file over ``limit`` bytes, or one that is not trace JSON, is refused in
    one line."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise UserError(f"cannot read the trace {path}: {e}") from None
    if len(data) > limit:
        raise UserError(f"{path} is over {limit / GiB:g} GiB, more than a trace is read up "
                        "to: trace fewer steps (e.g. --train.profile=20)")
    try:
        events = json.loads(data).get("traceEvents")
    except (ValueError, RecursionError, AttributeError) as e:
        raise UserError(f"{path} is not a trace's JSON ({type(e).__name__}: "
                        f"{str(e)[:120]}); it is not a file --train.profile wrote") from None
    if not isinstance(events, list):
        raise UserError(f"{path} has no traceEvents list; it is not a file --train.profile "
                        "wrote")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and _number(e.get("ts")) and _number(e.get("dur")) and e["dur"] >= 0]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals: overlaps count once."""
    return sum(e - s for s, e in _merged(intervals))


def outermost(events: list[dict]) -> list[dict]:
    """The events not inside another one on the same thread (a CPU operator's children
    would count its time twice)."""
    kept, end_by_thread = [], {}
    for e in sorted(events, key=lambda e: (str(e.get("pid")), str(e.get("tid")), e["ts"],
                                           -e["dur"])):
        thread = (str(e.get("pid")), str(e.get("tid")))
        if e["ts"] + e["dur"] <= end_by_thread.get(thread, float("-inf")):
            continue
        kept.append(e)
        end_by_thread[thread] = e["ts"] + e["dur"]
    return kept


def summarize_events(events: list[dict], top: int = TOP) -> dict:
    """``summarize_trace``'s numbers from a trace's complete events."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    work = device or outermost([e for e in events if e.get("cat") == "cpu_op"])
    steps = {e.get("name") for e in events if _STEP.fullmatch(str(e.get("name", "")))}
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
            if events else 0.0)
    busy = union_us([(e["ts"], e["ts"] + e["dur"]) for e in work])
    by_name: dict[str, list] = {}
    for e in work:
        entry = by_name.setdefault(str(e.get("name", "?")), [0.0, 0])
        entry[0] += e["dur"]
        entry[1] += 1
    total = sum(us for us, _ in by_name.values())
    per_step = 1e3 * max(1, len(steps))
    phases = {k: us / per_step for k, us in
              (device_phase_us(events, device) if device else host_phase_us(events)).items()}
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"source": "device" if device else "cpu", "steps": len(steps),
            "span_ms": span / 1e3, "busy_ms": busy / 1e3,
            "idle_share": max(0.0, 1.0 - busy / span) if span else 0.0,
            "phases_ms": phases,
            "top": [{"name": name, "ms": us / 1e3, "count": n,
                     "share": us / total if total else 0.0}
                    for name, (us, n) in ranked]}


def phase_ranges(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """The phase clock's ranges (``phase:<name>`` host annotations, on any thread) by
    phase, each phase's as sorted disjoint ``(start, end)`` intervals."""
    found: dict[str, list] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "user_annotation" and name.startswith(ANNOTATION):
            found.setdefault(name[len(ANNOTATION):], []).append((e["ts"], e["ts"] + e["dur"]))
    return {k: _merged(v) for k, v in found.items()}


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _inside(t: float, merged: list[tuple[float, float]]) -> bool:
    i = bisect.bisect_right(merged, (t, float("inf"))) - 1
    return i >= 0 and merged[i][0] <= t <= merged[i][1]


def host_phase_us(events: list[dict]) -> dict[str, float]:
    """Microseconds of each phase on the host's clock: its ranges' total length."""
    return {k: sum(e - s for s, e in v) for k, v in phase_ranges(events).items()}


def device_phase_us(events: list[dict], device: list[dict]) -> dict[str, float]:
    """Microseconds of device work per phase: each kernel (copy, memset) belongs to the
    phases whose host range was open when it was launched, on whichever thread (autograd
    launches the backward's kernels from a thread of its own, while the range is open on
    the main one), found through the launch's ``correlation`` id; a phase's time is the
    union of its kernels' intervals."""
    ranges = phase_ranges(events)
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") not in DEVICE_CATEGORIES and isinstance(e.get("args"), dict)
                and "correlation" in e["args"]}
    by_phase: dict[str, list] = {k: [] for k in ranges}
    for k in device:
        args = k.get("args") if isinstance(k.get("args"), dict) else {}
        t = launched.get(args.get("correlation"))
        if t is None:
            continue
        for phase, merged in ranges.items():
            if _inside(t, merged):
                by_phase[phase].append((k["ts"], k["ts"] + k["dur"]))
    return {k: union_us(v) for k, v in by_phase.items()}


def summarize_trace(path: str | Path) -> dict:
    """One rank's trace: source, steps, span_ms, busy_ms, idle_share and the top
    kernels (or CPU operators) with name, ms, count and share."""
    return summarize_events(read_trace(path))


def summarize_run_traces(run_dir: str | Path) -> dict[int, dict]:
    """Rank -> ``summarize_trace`` of each ``<run_dir>/trace/rank<r>.json``, in rank order
    ({} when the run wrote no trace)."""
    folder = Path(run_dir) / TRACE_DIR
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        m = _RANK_FILE.fullmatch(path.name)
        if m and path.is_file():
            found[int(m[1])] = path
    return {rank: summarize_trace(found[rank]) for rank in sorted(found)}


def trace_line(rank: int, s: dict, top: int = 3) -> str:
    """One line of a rank's summary, for ``hpctrain report``'s output."""
    what = "device kernels" if s["source"] == "device" else "host operators"
    names = ", ".join(f"{t['name']} {t['ms']:.1f} ms ({100 * t['share']:.0f}%)"
                      for t in s["top"][:top])
    return (f"trace rank {rank}: {s['steps']} step(s), span {s['span_ms']:.1f} ms, "
            f"{what} busy {s['busy_ms']:.1f} ms (idle {100 * s['idle_share']:.1f}%); "
            f"top: {names or '-'}"
            + (f"; per step: {phase_text(s)}" if s.get("phases_ms") else ""))


def phase_text(s: dict) -> str:
    """``forward 12.0 ms, backward 30.1 ms, ...``: a summary's phase ranges per step."""
    return ", ".join(f"{k} {v:.1f} ms" for k, v in s["phases_ms"].items())
