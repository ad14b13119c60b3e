"""One run per output directory: a lock, and no silent mixing with an earlier run.

Two jobs writing the same ``--train.out_dir`` replace each other's checkpoints and
interleave ``metrics.jsonl``; a fresh run in the directory of an earlier one would prune
or shadow its checkpoints. So before anything is written, rank 0:

1. takes ``<out_dir>/.hpctrain.lock`` (created exclusively; it holds host, PID, job id and
   start time). A lock whose holder is on this host and no longer alive is stale and is
   taken over; any other lock is an error naming its holder. ``--train.overwrite`` does
   not break a lock: a live job is never overwritten.
2. looks for an earlier run's outputs. A fresh run (``--train.resume=''``, or ``auto``
   without a checkpoint) in such a directory is refused with the two ways on
   (``--train.resume=auto`` or ``--train.overwrite``); with ``--train.overwrite`` the
   earlier outputs are moved into ``<out_dir>/previous-<UTC time>/``: nothing is deleted.

Every rank receives the verdict, so an error is raised everywhere alike (and printed
once by rank 0).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from hpctrain.checkpoint.sharded import remove_stale_temporaries
from hpctrain.comm.small_collectives import bcast_json
from hpctrain.comm.world import World
from hpctrain.errors import UserError

LOCK_NAME = ".hpctrain.lock"
# What a run writes into its out_dir; any of them means an earlier run was here.
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "final.h5", "sample.txt")
JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")


class RunDirError(UserError):
    """The output directory is in use by another job, or holds another run's outputs."""


def _holder() -> dict:
    job = next((os.environ[v] for v in JOB_ID_VARS if os.environ.get(v)), None)
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return (f"host {holder.get('host')}, PID {holder.get('pid')}{job}, since "
            f"{holder.get('started')}")


class RunDirLock:
    """``<out_dir>/.hpctrain.lock``, held by rank 0 for the life of a run."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK_NAME
        self.held = False
        self.took_over: dict | None = None
        """The stale holder replaced by ``acquire``, if any (for the log)."""
        self.notes: list[str] = []
        """What ``claim_run_dir`` did that the log should say."""

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = _holder()
        for _ in range(2):  # a second try after removing a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    continue  # released between our attempt and the read
                if not self._stale(holder, mine):
                    raise RunDirError(
                        f"{self.path.parent} is in use by another run ({_describe(holder)}); "
                        "give this run another --train.out_dir, or wait for that one. If "
                        f"no job uses it any more, remove {self.path}") from None
                self.took_over = holder
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self.held = True
            return
        raise RunDirError(f"could not take {self.path}: another run keeps creating it; "
                          "give this run another --train.out_dir")

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": "?", "pid": "?", "started": "? (unreadable lock file)"}

    @staticmethod
    def _stale(holder: dict, mine: dict) -> bool:
        """Our own process (a second trainer in one program), or a dead process on
        this host. A holder on another host cannot be checked from here."""
        if holder.get("host") != mine["host"] or not isinstance(holder.get("pid"), int):
            return False
        return holder["pid"] == mine["pid"] or not _pid_alive(holder["pid"])

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder is not None and holder.get("pid") == os.getpid() \
                and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)


def earlier_outputs(out_dir: Path) -> list[str]:
    return [name for name in RUN_OUTPUTS if (Path(out_dir) / name).exists()]


def has_checkpoint(out_dir: Path) -> bool:
    return (Path(out_dir) / "checkpoints" / "latest").is_file()


def move_aside(out_dir: Path, names: list[str]) -> Path:
    """Move an earlier run's outputs into ``previous-<UTC time>/`` (a rename: nothing is
    copied or deleted)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = Path(out_dir) / f"previous-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = Path(out_dir) / f"previous-{stamp}-{n}"
    dest.mkdir()
    for name in names:
        os.replace(Path(out_dir) / name, dest / name)
    return dest


def _claim(out_dir: Path, resume: str, overwrite: bool, lock: RunDirLock) -> dict:
    """Rank 0's part: the lock and the earlier run. Returns a verdict for every rank."""
    lock.acquire()
    notes = []
    if lock.took_over is not None:
        notes.append(f"took over a stale lock ({_describe(lock.took_over)})")
    # Holding the lock, no save of ours is in progress: temporaries are a killed job's.
    stale = remove_stale_temporaries(out_dir / "checkpoints")
    if stale:
        notes.append(f"removed {len(stale)} temporary file(s) of an interrupted save "
                     f"({', '.join(p.name for p in stale[:3])})")
    found = earlier_outputs(out_dir)
    continuing = resume not in ("", "auto") or (resume == "auto" and has_checkpoint(out_dir))
    if found and not continuing:
        if not overwrite:
            what = ("a checkpoint" if has_checkpoint(out_dir)
                    else "an earlier run's outputs")
            raise RunDirError(
                f"{out_dir} holds {what} ({', '.join(found)}); pass --train.resume=auto to "
                "continue it, --train.overwrite=true to start fresh (its outputs are moved "
                "into a previous-<time>/ folder), or another --train.out_dir")
        notes.append(f"earlier outputs moved to {move_aside(out_dir, found)}")
    return {"notes": notes}


def claim_run_dir(out_dir: Path, resume: str, overwrite: bool, world: World) -> RunDirLock:
    """Collective: rank 0 takes the lock and settles the earlier run; every rank gets
    the verdict (a ``RunDirError`` is raised on all ranks alike). Returns the lock
    (held on rank 0 only) with its log notes in ``lock.notes``."""
    lock = RunDirLock(out_dir)
    verdict = None
    if world.is_root:
        try:
            verdict = _claim(Path(out_dir), resume, overwrite, lock)
        except RunDirError as e:
            verdict = {"error": str(e)}
        except OSError as e:
            verdict = {"error": f"cannot use --train.out_dir={out_dir}: {e}"}
    verdict = bcast_json(world.comm, verdict, timeout=world.timeout,
                         what="output directory check")
    if "error" in verdict:
        lock.release()
        raise RunDirError(verdict["error"])
    lock.notes = verdict["notes"]
    return lock
