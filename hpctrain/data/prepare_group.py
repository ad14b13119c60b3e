"""Who prepares a token file: one process (``Solo``, no MPI) or every rank of an MPI
communicator (``Group``), behind the same few operations, so ``prepare.py`` runs one
algorithm on either. Every collective of a ``Group`` has a deadline (the watchdog, as
``prepare.py`` describes); ``attempt`` runs a step that a user can make fail (a path, a
permission) on every rank, and fails every rank with the first message.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from hpctrain.atomic import write_failed
from hpctrain.data.format import temp_name, write_all
from hpctrain.errors import DataError, UserError

# Test-only: the rank named here sleeps before a collective (the first one whose name
# contains HPCTRAIN_TEST_STALL_PREPARE_AT, or any), so that tests can check a stalled rank
# ends the job through the watchdog instead of hanging it. Never set it in a real job.
STALL_RANK_ENV = "HPCTRAIN_TEST_STALL_PREPARE_RANK"
STALL_AT_ENV = "HPCTRAIN_TEST_STALL_PREPARE_AT"


class Solo:
    """One process, no MPI: the same algorithm as ``Group`` on a world of one."""
    rank, size = 0, 1

    def allgather(self, obj, what: str):
        return [obj]

    def bcast(self, obj, what: str):
        return obj

    def check(self, error: str | None, what: str) -> None:
        if error:
            raise DataError(error)

    def create(self, path: Path, hints: dict) -> Path:
        def make():
            path.parent.mkdir(parents=True, exist_ok=True)
            return temp_name(path)
        return attempt(self, make, "temporary file")

    def write(self, tmp: Path, output: Path, hints: dict,
              writes: list[list[tuple[int, memoryview]]]) -> None:
        """Every round's bytes at their offsets in ``tmp`` (which becomes ``output``),
        flushed to the disk (``fsync`` reports what a write-back cache failed to store);
        a failed write is one message."""
        try:
            fd = os.open(tmp, os.O_WRONLY)
            try:
                for round_writes in writes:
                    for offset, data in round_writes:
                        write_all(fd, data, offset)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise write_failed(output, e) from None

    def barrier(self, what: str) -> None:
        pass


class Group(Solo):
    """Every rank of an MPI communicator. Every collective waits with a deadline
    (``timeout``, the watchdog): a rank that stalls or dies ends the job with a message
    naming the operation, instead of leaving the others spinning in it forever."""

    def __init__(self, comm, timeout: float):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.timeout = timeout
        stall = os.environ.get(STALL_RANK_ENV, "")
        self._stall = stall.isdigit() and int(stall) == self.rank

    def _deadline(self, what: str) -> dict:
        """Keyword arguments of the watchdog helpers for the operation ``what``."""
        if self._stall and os.environ.get(STALL_AT_ENV, "") in what:  # test-only, see above
            self._stall = False
            time.sleep(3600)
        return {"timeout": self.timeout, "what": f"prepare: {what}", "option": "--timeout"}

    def allgather(self, obj, what: str):
        from hpctrain.comm.small_collectives import allgather_json

        return allgather_json(self.comm, obj, **self._deadline(what))

    def bcast(self, obj, what: str):
        from hpctrain.comm.small_collectives import bcast_json

        return bcast_json(self.comm, obj, **self._deadline(what))

    def check(self, error: str | None, what: str) -> None:
        """Raise the first rank's error on every rank (nobody is left in a collective)."""
        errors = [e for e in self.allgather(error, f"{what} (error check)") if e]
        if errors:
            raise DataError(errors[0])

    def create(self, path: Path, hints: dict) -> Path:
        from mpi4py import MPI

        from hpctrain.data.mpiio import make_info

        # MPI-IO creates the file so that striping hints (striping_factor, striping_unit)
        # take effect on Lustre; h5py later truncates it, which keeps the striping.
        def name():
            if self.rank != 0:
                return None
            path.parent.mkdir(parents=True, exist_ok=True)
            return str(path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
        tmp = Path(self.bcast(attempt(self, name, "temporary file"), "temporary file name"))
        info = make_info(hints)
        try:
            # MPI_File_open is collective and blocking: every rank meets first, with a
            # deadline, so that the open never waits for a rank that is not coming.
            self.barrier("barrier before creating the file with MPI-IO")
            MPI.File.Open(self.comm, str(tmp), MPI.MODE_CREATE | MPI.MODE_WRONLY, info).Close()
        finally:
            info.Free()
        return tmp

    def write(self, tmp: Path, output: Path, hints: dict, writes) -> None:
        from hpctrain.data.mpiio_write import write_rounds

        write_rounds(self.comm, tmp, hints, writes, deadline=self._deadline,
                     barrier=self.barrier, shown=output)

    def barrier(self, what: str) -> None:
        from hpctrain.comm.small_collectives import barrier

        barrier(self.comm, **self._deadline(what))


def attempt(group, fn, what: str):
    """Run ``fn`` on every rank; a user-fixable failure anywhere fails every rank."""
    result, error = None, None
    try:
        result = fn()
    except UserError as exc:
        error = str(exc)
    except OSError as exc:
        error = f"{exc}; check the path and permissions"
    group.check(error, what)
    return result
