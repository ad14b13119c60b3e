"""Open the training dataset on every rank: one metadata read, optional staging to
node-local disk, the reader ``--data.reader`` names, and the prefetching thread.

Everything here is collective over the world, and a problem any rank meets (a corrupt
file, a full staging disk, an MPI-IO open that fails) becomes the same ``DataError`` on
every rank: one message, exit status 2, never a rank left waiting in a collective.
"""

from __future__ import annotations

from mpi4py import MPI

from hpctrain.comm.collectives import any_true
from hpctrain.data.dataset import DatasetInfo, TokenDataset, read_info
from hpctrain.data.hints import parse_hints
from hpctrain.data.mpiio import H5MPIODataset, MPIIODataset, h5py_has_mpi
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.stage import copy_files, staged_paths
from hpctrain.errors import DataError, UserError

_STAGE_BYTES_PER_S = 20e6  # slowest copy rate allowed for before staging times out


def resolve_reader(kind: str) -> str:
    """``auto`` is HDF5's mpio driver when h5py has MPI support, else our MPI-IO reader."""
    if kind == "auto":
        return "h5mpio" if h5py_has_mpi() else "mpiio"
    return kind


def agree(comm: MPI.Comm, fn, *, timeout: float, what: str):
    """Run ``fn`` on every rank; if it fails with an error a user can fix on any rank,
    raise that rank's message on every rank."""
    result, error = None, None
    try:
        result = fn()
    except UserError as exc:
        error = str(exc)
    except (OSError, MPI.Exception) as exc:
        error = f"{what} failed: {exc}"
    if comm.Get_size() > 1 and any_true(comm, error is not None, timeout=timeout, what=what):
        error = next(m for m in comm.allgather(error) if m)
    if error:
        raise DataError(error)
    return result


def share_info(path: str, comm: MPI.Comm) -> DatasetInfo:
    """Rank 0 reads and checks the metadata and every rank receives it: one process opens
    the HDF5 file, not thousands (a metadata storm on Lustre)."""
    info, error = None, None
    if comm.Get_rank() == 0:
        try:
            info = read_info(path)
        except DataError as exc:
            error = str(exc)
    info, error = comm.bcast((info, error), root=0)
    if error:
        raise DataError(error)
    return info


def open_dataset(cfg, world) -> Prefetcher:
    """The training data as configured by ``cfg`` (a ``DataConfig``) on ``world``."""
    info = share_info(cfg.path, world.comm)
    comm = world.comm
    if cfg.stage_dir:
        nbytes = sum(f.stat().st_size for f in info.files)
        agree(world.comm, lambda: copy_files(info, cfg.stage_dir) if world.local_rank == 0
              else None, timeout=world.timeout + nbytes / _STAGE_BYTES_PER_S,
              what="staging the dataset")
        info = info.with_files(staged_paths(info, cfg.stage_dir))
        # Each node reads its own copy: the copies are different files, so the
        # collective reads are collective over the node's ranks only.
        comm = world.local_comm
    kind = resolve_reader(cfg.reader)
    hints = parse_hints(cfg.romio_hints)

    def make():
        if kind == "mmap":
            return TokenDataset(info)
        cls = MPIIODataset if kind == "mpiio" else H5MPIODataset
        return cls(info, comm, hints=hints, timeout=world.timeout)

    reader = agree(world.comm, make, timeout=world.timeout, what=f"opening {cfg.path}")
    threaded = cfg.prefetch and (kind == "mmap" or MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    return Prefetcher(reader, timeout=world.timeout, threaded=threaded)
