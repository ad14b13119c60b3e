"""MPI's shared-memory segments kept out of /dev/shm on every exit path.

MPICH opens one segment per node by name, ``mpich_shm_<job id hex>_<node>``, and unlinks
the name only in ``MPI_Finalize``: an abort or a kill leaves 2 MiB behind, and on shared
nodes they pile up until later MPI starts fail. ``unlink_segment_names`` removes the
names once every rank has joined (the memory stays shared while mapped and goes with the
last rank, however it ends); ``sweep_when_done`` leaves a launcher's watcher that removes
what a launch left anyway (``leftovers``: this user's, new, held by no live process).
Windows from ``MPI_Win_allocate_shared`` need neither: MPICH unlinks their files at once.
Why each is safe, and what was measured: docs/design/failure-handling.md
("Shared-memory leftovers").
"""

from __future__ import annotations

import os
import re
import stat
import time

SHM_DIR = "/dev/shm"
MPICH_SEGMENT = re.compile(r"mpich_shm_[0-9a-f]+_[0-9]+")
"""The name of MPICH's per-node segment (``mpich_shm_%x_%d``: job id, node)."""
MPI_SEGMENTS = re.compile(r"mpich_shm_.+|sm_segment\..+|vader_segment\..+")
"""Any MPI's node-local segment this project knows: MPICH's, and Open MPI's (``sm``,
``vader``); what a job script's clean-up looks for."""
ANY_NAME = re.compile(r".+")
CLOCK_SLACK_S = 1.0
"""How much earlier than the launch a leftover may be stamped: tmpfs stamps files with
the kernel's coarse clock, a few milliseconds behind ``time.time()``."""
_WATCH_POLL_S = 0.1


def linked_mappings(maps_text: str, pattern: re.Pattern = MPICH_SEGMENT,
                    shm_dir: str = SHM_DIR) -> list[str]:
    """The paths under ``shm_dir`` mapped in ``maps_text`` (the text of /proc/PID/maps)
    whose names match ``pattern`` and are still linked (not marked ``(deleted)``), each
    once, in the order first mapped."""
    found: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue  # an anonymous mapping
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            continue  # unlinked already
        folder, _, name = path.rpartition("/")
        if folder == shm_dir and pattern.fullmatch(name) and path not in found:
            found.append(path)
    return found


def own_segments(pattern: re.Pattern = MPICH_SEGMENT) -> list[str]:
    """The still-linked /dev/shm segments this process maps ([] where /proc is missing)."""
    try:
        with open("/proc/self/maps") as f:
            return linked_mappings(f.read(), pattern)
    except OSError:
        return []


def unlink_segment_names(comm) -> list[str]:
    """Remove the names of the MPI segments this process maps, once every rank of
    ``comm`` is past ``MPI_Init`` (MPICH's init returns only when every rank of the node
    has the segment open); returns the paths this rank unlinked. Collective over
    ``comm``."""
    comm.Barrier()
    gone = []
    for path in own_segments():
        try:
            os.unlink(path)
            gone.append(path)
        except FileNotFoundError:
            pass  # another rank of the node was first
        except OSError:
            pass  # not ours to remove after all: finalize still unlinks it
    return gone


def held_paths(proc: str = "/proc", shm_dir: str = SHM_DIR) -> set[str]:
    """The files under ``shm_dir`` that a live process we can see holds open or maps
    (processes we may not inspect are skipped: only our own files are removed, and our
    processes are ours to see)."""
    held: set[str] = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"{proc}/{pid}/fd"):
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
                if target.startswith(shm_dir + "/"):
                    held.add(target)
            with open(f"{proc}/{pid}/maps") as f:
                held.update(linked_mappings(f.read(), ANY_NAME, shm_dir))
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return held


def leftovers(since: float, shm_dir: str = SHM_DIR, pattern: re.Pattern = MPICH_SEGMENT,
              held: set[str] | None = None, uid: int | None = None) -> list[str]:
    """MPI segments under ``shm_dir`` that a job of this user left: named as ``pattern``
    says (default MPICH's), owned by this user (``uid``), modified at ``since`` or later,
    and held by no live process (``held``, default ``held_paths()``: a running job keeps
    its segment open or mapped)."""
    uid = os.getuid() if uid is None else uid
    found = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (pattern.fullmatch(entry.name) and stat.S_ISREG(st.st_mode)
                and st.st_uid == uid and st.st_mtime >= since):
            found.append(entry.path)
    if not found:
        return []
    held = held_paths(shm_dir=shm_dir) if held is None else held
    return sorted(p for p in found if p not in held)


def remove_leftovers(since: float, shm_dir: str = SHM_DIR,
                     pattern: re.Pattern = MPICH_SEGMENT, uid: int | None = None) -> list[str]:
    """Remove ``leftovers(since, shm_dir, pattern, uid=uid)``; returns the paths removed."""
    gone = []
    for path in leftovers(since, shm_dir, pattern, uid=uid):
        try:
            os.unlink(path)
            gone.append(path)
        except OSError:
            pass
    return gone


def sweep_when_done() -> None:
    """Leave behind a watcher that, once this process has ended, removes the segments
    left since now (``remove_leftovers``). For a launcher about to ``exec`` ``mpiexec``:
    the launch keeps its process id, signals and exit status, and ranks that died
    before they could unlink the names (killed in ``MPI_Init``, or a program without
    ``unlink_segment_names``) leave nothing. The watcher has its own session (Ctrl-C
    and a timeout's kill of the launch do not reach it) and no standard streams (a
    caller reading the launch's output sees its end when the launch ends)."""
    since, launch = time.time() - CLOCK_SLACK_S, os.getpid()
    if os.fork() != 0:
        return
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        while os.getppid() == launch:  # reparented once the launch has ended
            time.sleep(_WATCH_POLL_S)
        remove_leftovers(since)
        time.sleep(1.0)  # a rank still exiting held its segment at the first look
        remove_leftovers(since)
    finally:
        os._exit(0)
