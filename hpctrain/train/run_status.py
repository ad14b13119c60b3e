"""How a run ended, in ``<out_dir>/status.json``: finished, stopped early and why, or
failed with which error.

A run stopped by a signal or by its time limit saves a checkpoint and exits 0, exactly as
a finished one does, so the exit status alone cannot tell them apart. Rank 0 writes this
file at the end of every run (and removes a stale one when a run starts), and job scripts
read it after the launcher returns, to print the truth and exit with a status the
scheduler can act on:

    python -m hpctrain.train.run_status RUN_DIR
    stopped 120 2000 SIGUSR1          (status, step, max_iters, reason)

The file's fields and the job's exit: docs/design/failure-handling.md
("The walltime, signals and Ctrl-C: stop, save, exit 0").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

STATUS_FILE = "status.json"
FINISHED = "finished"
STOPPED = "stopped"
FAILED = "failed"
"""An error ended the run; ``step`` is the checkpoint a resumed run would continue from
(0: none), ``reason`` the error in one line."""


def status_record(status: str, step: int, max_iters: int, reason: str = "",
                  skipped: str = "") -> dict:
    """The file's content: ``reason`` names what stopped the run (a signal's name, ``the
    time limit``); ``skipped`` what a stop after the last step left undone."""
    record = {"status": status, "step": step, "max_iters": max_iters}
    if reason:
        record["reason"] = reason
    if skipped:
        record["skipped"] = skipped
    return record


def write_status(out_dir: str | Path, record: dict) -> Path:
    """Replace ``<out_dir>/status.json`` in one step (a reader never sees half of it)."""
    path = Path(out_dir) / STATUS_FILE
    tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_status(out_dir: str | Path) -> dict | None:
    """The recorded status, or None when there is none (or it cannot be read)."""
    try:
        record = json.loads((Path(out_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "status" in record else None


def clear_status(out_dir: str | Path) -> None:
    """A run is starting: the status of the previous one no longer describes the run."""
    (Path(out_dir) / STATUS_FILE).unlink(missing_ok=True)


def shell_line(record: dict | None) -> str:
    """``status step max_iters reason`` for a job script's ``read`` (``unknown 0 0`` when
    there is no status)."""
    if record is None:
        return "unknown 0 0"
    reason = " ".join(str(record.get("reason", "")).split())  # one line
    return f"{record['status']} {int(record.get('step', 0))} " \
           f"{int(record.get('max_iters', 0))} {reason}".rstrip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hpctrain.train.run_status RUN_DIR", file=sys.stderr)
        return 2
    print(shell_line(read_status(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
