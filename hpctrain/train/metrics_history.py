"""One history in ``metrics.jsonl`` across a resume: an attempt killed after its last
checkpoint logged steps that the resumed run computes again, so on resume those records
move into ``previous-<UTC time>/metrics.jsonl`` (nothing is deleted) and each step keeps
one record, the resumed run's (docs/design/failure-handling.md)."""

from __future__ import annotations

import json
from pathlib import Path

from hpctrain.atomic import temporary_file
from hpctrain.train.rundir import new_previous_folder


def set_aside_records_after(path: Path, step: int) -> str | None:
    """Move the records of ``path`` whose step is past ``step`` into a new
    ``previous-<time>/`` beside it; the rest is rewritten whole (a temporary, renamed).
    Returns the log note, or None when there were none."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return None
    keep, later = [], []
    for line in lines:
        try:
            record_step = json.loads(line).get("step")
        except (ValueError, RecursionError, AttributeError):
            record_step = None  # not a record of ours: it stays where it was
        later_step = isinstance(record_step, int) and record_step > step
        (later if later_step else keep).append(line)
    if not later:
        return None
    dest = new_previous_folder(path.parent) / path.name
    dest.write_bytes(b"".join(later))
    with temporary_file(path) as tmp:
        tmp.write_bytes(b"".join(keep))
    return (f"{len(later)} record(s) past step {step} (an attempt that went on after its "
            f"last checkpoint) moved to {dest}: each step keeps the resumed run's record")
