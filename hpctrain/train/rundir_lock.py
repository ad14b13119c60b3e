"""``<out_dir>/.hpctrain.lock``: one run per output directory, also when many start at once.

The lock file holds its holder (host, PID, job id, start time) and is created whole by
``link`` from a temporary file (an atomic create-if-absent). A lock whose holder is on
this host and no longer alive is stale; any other lock is refused, naming its holder. A
stale lock is taken over only under an exclusive guard (``.hpctrain.lock.takeover``)
whose holder reads the lock again and replaces it by an atomic ``rename``, so two
starters never both hold it; ``flock`` is not used (node-local or absent on some
cluster file systems). A guard left behind is named for removal, never guessed at.
The race and how it is tested: docs/design/failure-handling.md ("One run per output directory").
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.file_modes import chmod_as_created

LOCK_NAME = ".hpctrain.lock"
GUARD_SUFFIX = ".takeover"
JOB_ID_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")
TRIES = 50
"""Looks at the lock before giving up while other starters keep changing it."""
GUARD_STALE_S = 30.0
"""A takeover guard older than this was left by a killed starter."""


class RunDirError(UserError):
    """The output directory is in use by another job, or holds another run's outputs."""


def holder_record() -> dict:
    """Who this process is, as the lock records it."""
    job = next((os.environ[v] for v in JOB_ID_VARS if os.environ.get(v)), None)
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host. An exited process its parent has not reaped (a
    zombie: a killed rank under a container's init that reaps nothing) holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: kill(0) said it exists
    return state not in ("Z", "X")


def describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return (f"host {holder.get('host')}, PID {holder.get('pid')}{job}, since "
            f"{holder.get('started')}")


def is_stale(holder: dict, mine: dict) -> bool:
    """Our own process (a second trainer in one program), or a dead process on this
    host. A holder on another host cannot be checked from here."""
    if holder.get("host") != mine["host"] or not isinstance(holder.get("pid"), int):
        return False
    return holder["pid"] == mine["pid"] or not _pid_alive(holder["pid"])


class RunDirLock:
    """``<out_dir>/.hpctrain.lock``, held by rank 0 for the life of a run."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / LOCK_NAME
        self.guard = self.path.with_name(LOCK_NAME + GUARD_SUFFIX)
        self.held = False
        self.took_over: dict | None = None
        """The stale holder replaced by ``acquire``, if any (for the log)."""
        self.notes: list[str] = []
        """What ``claim_run_dir`` did that the log should say."""

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = holder_record()
        for _ in range(TRIES):
            if self._create(mine):
                self.held = True
                return
            holder = self._read()
            if holder is None:
                continue  # released between our attempt and the read
            if not is_stale(holder, mine):
                raise RunDirError(
                    f"{self.path.parent} is in use by another run ({describe(holder)}); "
                    "give this run another --train.out_dir, or wait for that one. If "
                    f"no job uses it any more, remove {self.path}")
            if self._take_over(holder, mine):
                self.took_over, self.held = holder, True
                return
            time.sleep(0.01)  # another starter is taking it over: look again
        raise RunDirError(f"could not take {self.path}: other runs keep changing it; "
                          "give this run another --train.out_dir")

    def _record(self, mine: dict) -> Path:
        """A temporary file beside the lock holding ``mine``, whole."""
        fd, name = tempfile.mkstemp(prefix=f"{LOCK_NAME}.", suffix=".tmp",
                                    dir=self.path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(mine, f)
        chmod_as_created(name)  # mkstemp made it 0600
        return Path(name)

    def _create(self, mine: dict) -> bool:
        """Create the lock holding ``mine`` if there is none (``link``; an exclusive
        create where the file system has no hard links); False if there is one."""
        record = self._record(mine)
        try:
            os.link(record, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here: exclusive create, then the record
            return self._create_exclusive(mine)
        finally:
            record.unlink(missing_ok=True)

    def _create_exclusive(self, mine: dict) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:  # until written, readers see "unreadable": live
            json.dump(mine, f)
        return True

    def _take_over(self, stale: dict, mine: dict) -> bool:
        """Replace the lock holding ``stale`` with ``mine``, under the guard; False when
        another starter holds the guard or the lock is no longer ``stale``."""
        try:
            fd = os.open(self.guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            self._check_guard()
            return False
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            if self._read() != stale:
                return False
            record = self._record(mine)
            try:
                os.replace(record, self.path)
            except OSError:
                record.unlink(missing_ok=True)
                raise
            return True
        finally:
            self.guard.unlink(missing_ok=True)

    def _check_guard(self) -> None:
        """A guard older than GUARD_STALE_S was left by a starter killed mid-takeover."""
        try:
            age = time.time() - self.guard.stat().st_mtime
        except FileNotFoundError:
            return
        if age > GUARD_STALE_S:
            raise RunDirError(f"{self.guard} was left by a run killed while it took over "
                              f"the stale lock {self.path}; if no job uses "
                              f"{self.path.parent} any more, remove both and start again")

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"host": "?", "pid": "?", "started": "? (unreadable lock file)"}

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = self._read()
        if holder is not None and holder.get("pid") == os.getpid() \
                and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
