"""When this job must be done, asked of the scheduler from inside the job.

    python -m hpctrain.jobs.job_end [WALLTIME_S]      ->  1767225600 squeue

A generated script exports the first word as ``HPCTRAIN_JOB_END`` (epoch seconds), which
the trainer's deadline reads (``train/deadline.py``). Asking the scheduler (``squeue`` on
Slurm, ``qstat`` on PBS), rather than trusting the walltime the script was generated
with, honours what the submission changed and a requeued job's new start; without an
answer, ``$HPCTRAIN_JOB_START`` + ``WALLTIME_S``. The second word says which; nothing is
printed when no end is known.
Each scheduler's query and why: docs/design/job-scripts.md ("The job's end").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime

from hpctrain.systems.registry import walltime_seconds

_TIMEOUT_S = 30


def slurm_end(job_id: str, run=subprocess.run) -> float | None:
    out = _ask(["squeue", "-h", "-j", job_id, "-o", "%e"], run,
               {"SLURM_TIME_FORMAT": "standard"})
    return _local_time(out.strip(), "%Y-%m-%dT%H:%M:%S") if out else None


def pbs_end(job_id: str, run=subprocess.run) -> float | None:
    out = _ask(["qstat", "-f", job_id], run)
    if not out:
        return None
    fields = dict(re.findall(r"^\s*([\w.]+) = (.*)$", out, flags=re.MULTILINE))
    start = _local_time(fields.get("stime", "").strip(), "%a %b %d %H:%M:%S %Y")
    walltime = walltime_seconds(fields.get("Resource_List.walltime", "").strip())
    return start + walltime if start is not None and walltime else None


def _ask(argv: list[str], run, env: dict | None = None) -> str:
    try:
        p = run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S,
                env={**os.environ, **(env or {})})
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout if p.returncode == 0 else ""


def _local_time(text: str, fmt: str) -> float | None:
    try:
        return datetime.strptime(" ".join(text.split()), fmt).timestamp()
    except ValueError:
        return None


def job_end(env: dict, walltime_s: float | None = None,
            run=subprocess.run) -> tuple[float, str] | None:
    """(epoch seconds, source) of this job's end, or None when nothing says."""
    if env.get("SLURM_JOB_ID"):
        end = slurm_end(env["SLURM_JOB_ID"], run)
        if end is not None:
            return end, "squeue"
    elif env.get("PBS_JOBID"):
        end = pbs_end(env["PBS_JOBID"], run)
        if end is not None:
            return end, "qstat"
    try:
        start = float(env.get("HPCTRAIN_JOB_START", ""))
    except ValueError:
        start = time.time()
    if walltime_s:
        return start + walltime_s, "walltime"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    walltime = float(argv[0]) if argv and argv[0] else None
    found = job_end(os.environ, walltime)
    if found is not None:
        print(f"{found[0]:.0f} {found[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
