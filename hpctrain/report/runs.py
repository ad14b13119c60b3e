"""A run as the report sees it: its ``metrics.jsonl`` records on one clock, its summary
and a label that names its layout.

A resumed run appends a segment to ``metrics.jsonl`` each time it starts (``started_at``,
``start_step``, ``elapsed_s``). Joined, the wall clock runs on across segments (the time
between jobs is not counted), and a step logged again after a resume from an older
checkpoint is the later segment's: the abandoned records are dropped from the curves,
their time stays on the clock. Older records without these fields are split where the
step goes back.
The joining rules: docs/design/run-report.md ("Segments of a resumed run").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.report.trace_summary import summarize_run_traces
from hpctrain.sizes import MAX_EXPERTS, MAX_LAYERS

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


@dataclass
class Run:
    path: Path
    label: str
    records: list[dict]
    """Step records (``loss`` present), joined, each with ``wall_s`` on the run's clock
    and the index of its ``segment``."""
    final: dict | None = None
    """The ``final_val_loss`` record, with ``wall_s``; None until the run has one."""
    summary: dict | None = None
    """``summary.json``; None while the run is going (or when it stopped early)."""
    segments: int = 1
    notes: list[str] = field(default_factory=list)
    traces: dict[int, dict] = field(default_factory=dict)
    """Rank -> the summary of its ``--train.profile`` trace (``trace_summary.py``)."""


NUMBERS = ("loss", "val_loss", "final_val_loss", "lr", "mfu", "tokens_per_s", "step_ms",
           "elapsed_s", "started_at", "start_step", "wall_s", "moe_imbalance")
"""The fields of a record the report computes or plots with: numbers, or null."""


def _number_or_none(value) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _load_table(value) -> bool:
    """Absent, or a table of token counts: a row per MoE layer, a number per expert."""
    if value is None:
        return True
    return (isinstance(value, list) and 0 < len(value) <= MAX_LAYERS
            and all(isinstance(row, list) and 0 < len(row) <= MAX_EXPERTS
                    and all(_number_or_none(c) and c is not None for c in row)
                    for row in value))


def read_records(path: Path) -> tuple[list[dict], list[str]]:
    """The records of a ``metrics.jsonl``. A last line without its newline is a record
    still being written (skipped, with a note); any other line that is not a JSON
    object is an error naming the line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e}") from None
    lines = text.split("\n")
    partial = lines.pop()  # '' when the file ends with a newline
    notes = [f"{path}: skipped a partial last line (a record still being written)"] \
        if partial.strip() else []
    records = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            record, why = None, str(e)
        else:
            why = "not a JSON object with a step"
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            wrong = next((k for k in NUMBERS if not _number_or_none(record.get(k))), None)
            if wrong is None and not _load_table(record.get("moe_load")):
                wrong = "moe_load"
            if wrong is None:
                records.append(record)
                continue
            why = (f"{wrong} is {str(record[wrong])[:80]}, not a table of numbers (a row "
                   "per MoE layer)" if wrong == "moe_load"
                   else f"{wrong} is {record[wrong]!r}, not a number")
        raise UserError(f"{path}, line {n}: {why}; it is not a metrics.jsonl record "
                        "that hpctrain wrote (repair or remove that line)")
    return records, notes


def _segment_key(record: dict):
    return record.get("started_at"), record.get("start_step")


def split_segments(records: list[dict]) -> list[list[dict]]:
    """Consecutive records of one start of the run; a new segment where the start
    changes (or, without those fields, where the step goes back)."""
    segments: list[list[dict]] = []
    for r in records:
        last = segments[-1][-1] if segments else None
        new = last is None or _segment_key(r) != _segment_key(last) or (
            r.get("started_at") is None and r["step"] < last["step"])
        if new:
            segments.append([r])
        else:
            segments[-1].append(r)
    return segments


def _elapsed(segment: list[dict], resumed_at: int) -> list[float]:
    """Seconds into the segment of each record: ``elapsed_s``, else the step times
    summed from the step it resumed at."""
    if all("elapsed_s" in r for r in segment):
        return [float(r["elapsed_s"]) for r in segment]
    out, t, prev = [], 0.0, resumed_at
    for r in segment:
        t += (r.get("step_ms") or 0.0) / 1e3 * max(0, r["step"] - prev)
        prev = max(prev, r["step"])
        out.append(t)
    return out


def join_segments(segments: list[list[dict]]) -> tuple[list[dict], dict | None]:
    """(step records on one clock, the last final-evaluation record or None)."""
    kept: list[dict] = []
    final = None
    offset = 0.0
    for index, segment in enumerate(segments):
        resumed_at = segment[0].get("start_step")
        if resumed_at is None:  # older records: from the last earlier step logged before
            resumed_at = max((r["step"] for r in kept if r["step"] < segment[0]["step"]),
                             default=0)
        kept = [r for r in kept if r["step"] <= resumed_at]
        if final is not None and final["step"] > resumed_at:
            final = None
        times = _elapsed(segment, resumed_at)
        for r, t in zip(segment, times):
            r = {**r, "wall_s": offset + t, "segment": index}
            if "final_val_loss" in r:
                final = r
            elif "loss" in r:
                kept.append(r)
        offset += times[-1]
    return kept, final


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise UserError(f"cannot read {path}: {e}; it is not a summary hpctrain wrote") \
            from None
    return data if isinstance(data, dict) else None


def _config_record(path: Path, summary: dict | None) -> tuple[dict, int | None]:
    """The run's configuration and world size: the summary's, else the newest
    checkpoint's (a run still going)."""
    if summary and isinstance(summary.get("config"), dict):
        return summary["config"], summary.get("world_size")
    latest = path / "checkpoints" / "latest"
    try:
        manifest = json.loads((path / "checkpoints" / latest.read_text().strip()
                               / "manifest.json").read_text())
        return manifest.get("config") or {}, manifest.get("world_size")
    except (OSError, ValueError, RecursionError, AttributeError):
        return {}, None  # no readable manifest: the label goes without the layout


def layout_label(name: str, config: dict, world: int | None) -> str:
    """``NAME: dp=2 pp=1 tp=1 zero=0, 4x128`` (the layout and the model's depth x width),
    as much of it as the run recorded."""
    par, model = config.get("parallel") or {}, config.get("model") or {}
    if not par or not world:
        return name
    pp, tp = par.get("pp", 1), par.get("tp", 1)
    text = f"{name}: dp={world // (pp * tp)} pp={pp} tp={tp} zero={par.get('zero', 0)}"
    if model.get("n_layer") and model.get("n_embd"):
        text += f", {model.get('arch', 'gpt')} {model['n_layer']}x{model['n_embd']}"
    return text


def read_run(path: str | Path) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; give the --train.out_dir of a run")
    if not (path / METRICS).is_file():
        raise UserError(f"{path} holds no {METRICS}; give the --train.out_dir of a run "
                        "that has logged at least one step")
    records, notes = read_records(path / METRICS)
    segments = split_segments(records)
    steps, final = join_segments(segments) if segments else ([], None)
    if not steps:
        notes.append(f"{path}: no step logged yet")
    summary = _read_json(path / SUMMARY)
    if summary and steps and isinstance(summary.get("steps"), int) \
            and summary["steps"] < steps[-1]["step"]:
        notes.append(f"{path}: summary.json is from an earlier segment (step "
                     f"{summary['steps']}); its phases and memory describe that one")
    config, world = _config_record(path, summary)
    return Run(path, layout_label(path.name, config, world), steps, final, summary,
               len(segments), notes, summarize_run_traces(path))
