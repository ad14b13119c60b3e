"""MPI's shared-memory segment names removed from /dev/shm once every rank has joined.

MPICH (ch4's POSIX shared memory) opens one segment per node by name, ``mpich_shm_<job
id hex>_<node>``, and unlinks that name only in ``MPI_Finalize``. Every exit that skips
finalize (an abort, a kill, a signal the rank dies of) left a 2 MiB file behind, and on
shared nodes they pile up until later MPI starts fail. Once every rank of the job is past
``MPI_Init`` (a barrier), every rank of a node has the segment open and mapped, and
nobody opens it by name again, so the name can go at once: the memory stays shared
while mapped and the kernel frees it when the last rank's process ends, whatever way it
ends. ``MPI_Finalize`` later unlinks a name that is gone and ignores the error.

Only names this process itself maps and that match MPICH's pattern are touched, never
another job's. Windows from ``MPI_Win_allocate_shared`` (our shared-memory allreduce)
need nothing: MPICH unlinks their files as soon as they are mapped. Other MPIs (Open MPI)
use other names and are left alone. Why and what was measured:
docs/design/failure-handling.md ("Shared-memory leftovers").
"""

from __future__ import annotations

import os
import re

SHM_DIR = "/dev/shm"
MPICH_SEGMENT = re.compile(r"mpich_shm_[0-9a-f]+_[0-9]+")
"""The name of MPICH's per-node segment (``mpich_shm_%x_%d``: job id, node)."""


def linked_mappings(maps_text: str, pattern: re.Pattern = MPICH_SEGMENT) -> list[str]:
    """The paths under /dev/shm mapped in ``maps_text`` (the text of /proc/PID/maps)
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
        if folder == SHM_DIR and pattern.fullmatch(name) and path not in found:
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
