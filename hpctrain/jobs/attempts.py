"""Where a generated job keeps its records: one folder per attempt in its run directory.

    <run dir>/jobs/<job id>/        the first attempt of a job
    <run dir>/jobs/<job id>.2/      a requeue under the same id (Slurm, PBS -r y)
    <run dir>/jobs/<other id>/      a resubmission of the same script

The run directory is the job's, not an attempt's: every attempt trains there, resuming
from the last checkpoint (``templates/base.sh.j2`` makes these folders).
"""

from __future__ import annotations

from pathlib import Path

ATTEMPTS = "jobs"


def attempts(run_dir: str | Path) -> list[Path]:
    """Every attempt's folder, oldest first (by the time it was made)."""
    folder = Path(run_dir) / ATTEMPTS
    if not folder.is_dir():
        return []
    return sorted((d for d in folder.iterdir() if d.is_dir()),
                  key=lambda d: (d.stat().st_mtime, d.name))


def latest_attempt(run_dir: str | Path) -> Path | None:
    found = attempts(run_dir)
    return found[-1] if found else None
