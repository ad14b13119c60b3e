"""Remove the shared-memory files a job's MPI ranks left in /dev/shm (job scripts).

    python -m hpctrain.jobs.shm_leftovers SINCE_FILE

A rank killed by a signal (SIGKILL, MPI_Abort) never unlinks its MPI library's node-local
segments: MPICH's ``mpich_shm_*``, Open MPI's ``sm_segment.*`` and ``vader_segment.*``.
They fill /dev/shm, and a requeued Slurm job, whose step has the same id again, finds
MPICH's stale segment under the same name and fails in MPI_Init. A file is this job's
when all of these hold: its name has one of those forms, this user owns it, it was
modified at or after SINCE_FILE (written just before the launch), and no process has it
open or mapped (a live job's ranks map theirs). The rule and why: docs/design/job-scripts.md
("Shared-memory leftovers"). ``HPCTRAIN_SHM_DIR`` names another folder (the tests).
"""

from __future__ import annotations

import fnmatch
import os
import sys
from pathlib import Path

SHM_DIR_ENV = "HPCTRAIN_SHM_DIR"
PATTERNS = ("mpich_shm_*", "sm_segment.*", "vader_segment.*")


def candidates(shm_dir: Path, since: float, uid: int) -> list[Path]:
    """Files of ``shm_dir`` named like an MPI segment, owned by ``uid``, modified at or
    after ``since`` (seconds since the epoch)."""
    found = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    for entry in entries:
        if not any(fnmatch.fnmatchcase(entry.name, p) for p in PATTERNS):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if entry.is_file(follow_symlinks=False) and st.st_uid == uid and st.st_mtime >= since:
            found.append(Path(entry.path))
    return sorted(found)


def in_use(proc: Path = Path("/proc")) -> set[str]:
    """Every path a process this user can see has open or mapped."""
    used: set[str] = set()
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            for line in (pid / "maps").read_text(errors="replace").splitlines():
                parts = line.split(maxsplit=5)
                if len(parts) == 6:
                    used.add(parts[5].removesuffix(" (deleted)"))
            for fd in (pid / "fd").iterdir():
                used.add(os.readlink(fd))
        except OSError:  # gone meanwhile, or another user's
            continue
    return used


def remove_leftovers(shm_dir: Path, since: float, uid: int | None = None) -> list[Path]:
    """Remove this job's leftovers (see the module docstring); the paths removed."""
    uid = os.getuid() if uid is None else uid
    found = candidates(shm_dir, since, uid)
    if not found:
        return []
    used = in_use()
    removed = []
    for path in found:
        if str(path) in used or str(path.resolve()) in used:
            continue
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


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
    shm_dir = Path(os.environ.get(SHM_DIR_ENV) or "/dev/shm")
    removed = remove_leftovers(shm_dir, since)
    if removed:
        print(f"hpctrain job: removed {len(removed)} shared-memory file(s) the ranks left in "
              f"{shm_dir}: {' '.join(p.name for p in removed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
