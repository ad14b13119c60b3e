"""Writing byte ranges of one file from every rank with collective MPI-IO, checked.

A write that comes up short must never pass in silence, and ROMIO's nonblocking
``MPI_File_iwrite_at_all`` can report a full count for a partial write. So each write is
checked three ways (the request's status, ``MPI_File_sync``, ``MPI_File_get_size``), and
every rank makes the same collective calls in the same order, failed or not, raising its
first failure after the file is closed. Why each check, and what none of them catches:
``docs/design/data-path.md`` ("Writing the file").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpctrain.atomic import WRITE_FIX
from hpctrain.comm.mpi import MPI
from hpctrain.comm.watchdog import wait
from hpctrain.data.mpiio import make_info
from hpctrain.errors import DataError


def open_for_writing(comm: MPI.Comm, path: Path, info: MPI.Info) -> MPI.File:
    """``MPI_File_open`` for writing (collective): where the tests substitute a file
    whose writes come up short."""
    return MPI.File.Open(comm, str(path), MPI.MODE_WRONLY, info)


def write_rounds(comm: MPI.Comm, path: Path, hints: dict, writes, *, deadline, barrier,
                 shown: Path) -> None:
    """Write ``writes`` (rounds of ``(byte offset, bytes)``, as many rounds on every rank)
    into the existing file ``path`` and check them (module docstring). ``deadline(what)``
    gives the watchdog's keyword arguments for one wait, ``barrier(what)`` meets every
    rank with a deadline (``File.Open``, ``Sync`` and ``Close`` block). Raises
    ``DataError`` with the first failure of this rank, naming the file as ``shown`` (the
    name ``path`` is written for)."""
    info = make_info(hints)
    barrier("barrier before opening the file with MPI-IO")
    fh = open_for_writing(comm, path, info)
    info.Free()
    errors: list[str] = []
    empty, ends = np.empty(0, np.uint8), [0]
    for k, round_writes in enumerate(writes):
        for offset, data in (round_writes if not errors else []) or [(0, empty)]:
            what = f"write round {k + 1} of {len(writes)} (Iwrite_at_all)"
            errors += _write_one(fh, offset, data, deadline(what))
            ends.append(offset + len(data))
    barrier("barrier before syncing the file")
    errors += _sync(fh)
    size = fh.Get_size()
    if size < max(ends):
        errors.append(f"the file has {size:,} bytes after the writes, which reach byte "
                      f"{max(ends):,}")
    barrier("barrier before closing the file")
    fh.Close()
    if errors:
        raise DataError(f"writing {shown} failed: {errors[0]}; {WRITE_FIX}")


def _write_one(fh: MPI.File, offset: int, data, deadline: dict) -> list[str]:
    """One collective nonblocking write, waited for with a deadline (a missed one, a
    ``CommTimeout``, propagates at once and aborts the job); returns what went wrong."""
    status = MPI.Status()
    try:
        wait(fh.Iwrite_at_all(offset, [data, MPI.BYTE]), status=status, **deadline)
    except MPI.Exception as exc:
        return [" ".join(str(exc).split())]
    written = status.Get_count(MPI.BYTE)
    if written != len(data):
        return [f"{written:,} of {len(data):,} bytes were written at offset {offset:,}"]
    return []


def _sync(fh: MPI.File) -> list[str]:
    try:
        fh.Sync()
    except MPI.Exception as exc:
        return [f"flushing the writes: {' '.join(str(exc).split())}"]
    return []
