"""Read token windows with collective MPI-IO: each rank reads exactly its own bytes.

The token arrays are contiguous, so a window of a split is a byte range at a known
offset. Every rank opens the dataset's files once, collectively, and reads each of its
windows with ``MPI_File_read_at_all`` straight into the batch buffer: nothing else is
read, nothing is cached. One read per window rather than a file view, ROMIO's
collective buffering and data sieving off, and the Open MPI component check
(``mpiio_component``) were chosen by measurement; ``H5MPIODataset`` reads the same
windows through HDF5's ``mpio`` driver. Numbers and reasons:
``docs/design/data-path.md`` ("Reading: one collective read per window").
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpctrain.comm.mpi import MPI
from hpctrain.comm.resources import MPIResources
from hpctrain.comm.small_collectives import allreduce_array
from hpctrain.data.dataset import BaseReader, DatasetInfo, check_windows, window_pieces
from hpctrain.data.hints import READ_DEFAULTS
from hpctrain.errors import DataError

_DEFAULT_TIMEOUT_S = 300.0


def make_info(hints: dict[str, str]) -> MPI.Info:
    info = MPI.Info.Create()
    for key, value in hints.items():
        info.Set(key, str(value))
    return info


# Open MPI reads MCA parameters from the environment first, then from these files.
_OMPI_PARAM_FILES = ("~/.openmpi/mca-params.conf", "/etc/openmpi/openmpi-mca-params.conf")


def library_name() -> str:
    """The MPI library, briefly: ``Open MPI v4.1.4``, ``MPICH Version: 4.2.0``."""
    text = MPI.Get_library_version().replace("\x00", "").strip()  # Open MPI ends in NUL
    first = (text.splitlines() or ["unknown MPI"])[0]
    return " ".join(first.split(",")[0].split())


def _ompi_io_param(env) -> tuple[str, str] | None:
    """(value, where it was set) of Open MPI's ``io`` MCA parameter, if set."""
    if env.get("OMPI_MCA_io"):
        return env["OMPI_MCA_io"], "OMPI_MCA_io"
    files = env.get("OMPI_MCA_mca_base_param_files", "")
    for name in (files.split(":") if files else _OMPI_PARAM_FILES):
        path = Path(name).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, sep, value = line.split("#", 1)[0].partition("=")
            if sep and key.strip() == "io" and value.strip():
                return value.strip(), str(path)
    return None


def mpiio_component(library: str | None = None, env=None) -> tuple[str, str]:
    """(``"ROMIO"`` or ``"OMPIO"``, why) for this MPI library: Open MPI's ``io``
    parameter decides there (a list includes components, ``^`` excludes them; OMPIO
    wins when both remain); every other MPI this project meets uses ROMIO."""
    library = library_name() if library is None else library
    env = os.environ if env is None else env
    if not library.startswith("Open MPI"):
        return "ROMIO", library
    param = _ompi_io_param(env)
    if param is None:
        return "OMPIO", f"{library}'s default"
    value, where = param
    names = [n.strip() for n in value.lstrip("^").split(",") if n.strip()]
    if value.startswith("^"):
        romio = "ompio" in names
    else:
        romio = any(n.startswith("romio") for n in names) and "ompio" not in names
    return ("ROMIO" if romio else "OMPIO"), f"{library}, io={value} from {where}"


def describe_reader(reader) -> str:
    """One line for the start-up log: the reader and, for MPI-IO, which implementation
    reads and whether the ROMIO hints apply."""
    name = type(reader).__name__
    hints = getattr(reader, "hints", None)
    if hints is None:
        return f"{name} (memory map, no MPI-IO)"
    component, why = mpiio_component()
    text = ",".join(f"{k}={v}" for k, v in hints.items())
    if component == "ROMIO":
        return f"{name} through ROMIO ({why}), hints {text}"
    return (f"{name} through OMPIO ({why}): ROMIO hints ignored, small random reads "
            "are several times slower; OMPI_MCA_io=romio321 (Open MPI 4; romio341 in 5) "
            "selects ROMIO")


def h5py_has_mpi() -> bool:
    import h5py

    return bool(h5py.get_config().mpi)


class _CollectiveReader(BaseReader):
    """Shared part of the MPI readers: a private communicator, the per-file plan of a
    read, agreement on the number of collective calls, and closing at exit."""

    def __init__(self, info: DatasetInfo, comm: MPI.Comm, *, timeout: float):
        super().__init__(info)
        # Closing a file is collective: files and communicator are released together,
        # newest first, by close() or at exit (hpctrain/comm/resources.py).
        self.resources = MPIResources()
        # A private communicator: reads may run in a background thread while the
        # training thread uses ``comm`` for gradients.
        self.comm = self.resources.add(comm.Dup())
        self.timeout = timeout

    def _plan(self, split: str, starts, length: int, uniform: bool):
        """The output array, and per file the (first token, part, destination bytes) of
        every piece to read and how many collective calls the file gets."""
        s = self.splits[split]
        starts = np.asarray(starts, dtype=np.int64)
        item = s.dtype.itemsize
        raw = np.empty((len(starts), length * item), dtype=np.uint8)
        per_file: list[list] = [[] for _ in self.info.files]
        if len(s.parts) == 1:  # one array: one piece per window
            check_windows(s, starts, length)
            part = s.parts[0]
            per_file[part.file] = [(part, first, raw[row])
                                   for row, first in enumerate(starts.tolist())]
        else:
            for row, col, part, first, count in window_pieces(s, starts, length):
                per_file[part.file].append((part, first,
                                            raw[row, col * item:(col + count) * item]))
        calls = [len(p) for p in per_file]
        if self.comm.Get_size() > 1 and not (uniform and len(per_file) == 1):
            calls = allreduce_array(self.comm, calls, timeout=self.timeout, op=MPI.MAX,
                                    what=f"agreeing on the number of {split} reads").tolist()
        return raw.view(s.dtype), per_file, calls

    def close(self) -> None:
        """Close the files and free the communicator (collective; idempotent)."""
        self.resources.close()


class MPIIODataset(_CollectiveReader):
    """Collective MPI-IO reads at the arrays' byte offsets (works with serial h5py)."""

    def __init__(self, info: DatasetInfo, comm: MPI.Comm, *, hints: dict | None = None,
                 timeout: float = _DEFAULT_TIMEOUT_S):
        super().__init__(info, comm, timeout=timeout)
        self.hints = {**READ_DEFAULTS, **(hints or {})}
        mpi_info = make_info(self.hints)
        try:
            self._files = [self.resources.add(fh, fh.Close) for fh in (
                MPI.File.Open(self.comm, str(f), MPI.MODE_RDONLY, mpi_info)
                for f in info.files)]
        finally:
            mpi_info.Free()
        self._status = MPI.Status()
        self._empty = np.empty(0, np.uint8)

    def read(self, split: str, starts, length: int, *, uniform: bool = False) -> np.ndarray:
        out, per_file, calls = self._plan(split, starts, length, uniform)
        item, status = out.dtype.itemsize, self._status
        for fh, pieces, n_calls in zip(self._files, per_file, calls):
            for k in range(int(n_calls)):
                if k >= len(pieces):  # this rank has no more windows in this file
                    fh.Read_at_all(0, self._empty)
                    continue
                part, first, raw = pieces[k]
                fh.Read_at_all(part.offset + first * item, raw, status)
                if status.Get_count(MPI.BYTE) != len(raw):
                    raise DataError(f"{self.info.files[part.file]} ended early while reading "
                                    f"{split} tokens: it was truncated after training "
                                    "started; re-create or re-copy it")
        return out.astype(np.int64)


class H5MPIODataset(_CollectiveReader):
    """The same windows read through parallel HDF5 (h5py built with MPI), as hyperslabs
    with collective transfers. Only available where ``h5py.get_config().mpi`` is true."""

    def __init__(self, info: DatasetInfo, comm: MPI.Comm, *, hints: dict | None = None,
                 timeout: float = _DEFAULT_TIMEOUT_S):
        import h5py

        if not h5py_has_mpi():
            raise DataError("--data.reader=h5mpio needs h5py built with MPI "
                            "(CC=mpicc HDF5_MPI=ON pip install --no-binary=h5py h5py); "
                            "use --data.reader=mpiio with this h5py")
        super().__init__(info, comm, timeout=timeout)
        self.hints = {**READ_DEFAULTS, **(hints or {})}
        mpi_info = make_info(self.hints)
        try:
            self._files = [self.resources.add(h5, h5.close) for h5 in (
                h5py.File(f, "r", driver="mpio", comm=self.comm, info=mpi_info)
                for f in info.files)]
        finally:
            mpi_info.Free()
        self._dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
        self._dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)

    def read(self, split: str, starts, length: int, *, uniform: bool = False) -> np.ndarray:
        import h5py

        out, per_file, calls = self._plan(split, starts, length, uniform)
        for f, pieces, n_calls in zip(self._files, per_file, calls):
            dset = f[split].id
            for k in range(int(n_calls)):
                fspace = dset.get_space()
                if k >= len(pieces):  # an empty selection keeps the call collective
                    fspace.select_none()
                    mspace = h5py.h5s.create_simple((1,))
                    mspace.select_none()
                    dset.read(mspace, fspace, np.empty(1, out.dtype), dxpl=self._dxpl)
                    continue
                _, first, raw = pieces[k]
                dest = raw.view(out.dtype)
                fspace.select_hyperslab((first,), (dest.size,))
                dset.read(h5py.h5s.create_simple((dest.size,)), fspace, dest, dxpl=self._dxpl)
        return out.astype(np.int64)
