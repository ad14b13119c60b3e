"""Remove the shared-memory files a job's MPI ranks left in /dev/shm (job scripts).

    python -m hpctrain.jobs.shm_leftovers SINCE_FILE

A rank killed by a signal (SIGKILL, MPI_Abort) never unlinks its MPI library's node-local
segments: MPICH's ``mpich_shm_*``, Open MPI's ``sm_segment.*`` and ``vader_segment.*``.
They fill /dev/shm, and a requeued Slurm job, whose step has the same id again, finds
MPICH's stale segment under the same name and fails in MPI_Init. A file is this job's
when all of these hold: its name has one of those forms, this user owns it, it was
modified at or after SINCE_FILE (written just before the launch), and no process has it
open or mapped (a live job's ranks map theirs): ``comm/shm_segments.py``'s rule, which
the launcher of local runs applies too. The rule and why: docs/design/job-scripts.md
("Shared-memory leftovers"). ``HPCTRAIN_SHM_DIR`` names another folder (the tests).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hpctrain.comm.shm_segments import MPI_SEGMENTS, SHM_DIR, remove_leftovers

SHM_DIR_ENV = "HPCTRAIN_SHM_DIR"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hpctrain.jobs.shm_leftovers SINCE_FILE", file=sys.stderr)
        return 2
    try:
        since = Path(argv[0]).stat().st_mtime
    except OSError as exc:
        print(f"hpctrain job: warning: no shared-memory clean-up: {exc}", file=sys.stderr)
        return 0
    shm_dir = os.environ.get(SHM_DIR_ENV) or SHM_DIR
    removed = remove_leftovers(since, shm_dir, MPI_SEGMENTS)
    if removed:
        print(f"hpctrain job: removed {len(removed)} shared-memory file(s) the ranks left in "
              f"{shm_dir}: {' '.join(Path(p).name for p in removed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
