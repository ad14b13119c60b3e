"""Open the training dataset on every rank: one metadata read, an optional copy to
node-local disk, the reader ``--data.reader`` names, and the prefetching thread; then
``BatchLoader`` hands the trainer each step's rows as tensors on its device.

Everything here is collective over the world, and a problem any rank meets (a corrupt
file, a full node-local disk, an MPI-IO open that fails) becomes the same ``DataError`` on
every rank: one message, exit status 2, never a rank left waiting in a collective.
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.comm.device import Accelerator
from hpctrain.comm.mpi import MPI
from hpctrain.comm.small_collectives import allreduce_array, any_true
from hpctrain.comm.world import THREAD_LEVEL_HINT, THREAD_LEVELS
from hpctrain.config import parse_hints
from hpctrain.data.dataset import DatasetInfo, TokenDataset, read_info
from hpctrain.data.mpiio import H5MPIODataset, MPIIODataset, describe_reader, h5py_has_mpi
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.sampler import EVAL_STREAM, all_windows, make_sampler
from hpctrain.data.local_copy import local_copy_paths, make_local_copy
from hpctrain.errors import DataError, UserError

_COPY_BYTES_PER_S = 20e6  # slowest rate allowed for before the node-local copy times out


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
    if cfg.local_copy_dir:
        nbytes = sum(f.stat().st_size for f in info.files)
        agree(world.comm, lambda: make_local_copy(info, cfg.local_copy_dir)
              if world.local_rank == 0 else None,
              timeout=world.timeout + nbytes / _COPY_BYTES_PER_S,
              what="making the node-local copy of the dataset")
        info = info.with_files(local_copy_paths(info, cfg.local_copy_dir))
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


def check_token_ids(tokens: np.ndarray, vocab_size: int, path, split: str) -> None:
    """Every id read lies in the dataset's vocabulary: a file whose checksums agree may
    still hold others (written by another tool or tokenizer), which the embedding would
    meet as an index error steps later."""
    if tokens.size and (int(tokens.max()) >= vocab_size or int(tokens.min()) < 0):
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise DataError(f"{path}: the {split} split holds token id {bad}, outside its "
                        f"vocabulary of {vocab_size}: the file is damaged or was written "
                        "with another tokenizer; prepare it again")


def thread_note(prefetch: bool, threaded: bool, level: int) -> str:
    """Why batches are read in the main thread when prefetching was asked for
    (``prefetch``) but the reader has no thread: the background reader calls MPI-IO beside
    training's MPI, which needs MULTIPLE (``level``: ``MPI.Query_thread()``)."""
    if not prefetch or threaded:
        return ""
    return (f"; read in the main thread, not in the background: MPI thread level "
            f"{THREAD_LEVELS.get(level, '?')}, not multiple ({THREAD_LEVEL_HINT})")


def verify_dataset(data: Prefetcher, world, local_copy: bool) -> None:
    """Every rank checks the CRC of a share of the blocks; all agree on the verdict.
    Staged copies are checked node by node: each node reads its own copy."""
    w = world
    bad = data.verify(w.local_rank if local_copy else w.rank,
                      w.local_size if local_copy else w.size)
    n_bad = int(allreduce_array(w.comm, [len(bad)], timeout=w.timeout,
                                what="dataset checksum verdict")[0])
    if n_bad:
        detail = f" ({', '.join(bad[:3])})" if bad else ""
        raise DataError(f"{data.path}: {n_bad} block(s) fail their CRC-32 check"
                        f"{detail}; the file is corrupt, re-create it with `hpctrain prepare`")


def check_can_decode(tokenizer) -> None:
    """Before step 0: the end-of-run sample will decode with ``tokenizer``, whose files or
    package (GPT-2's BPE file, ``tokenizers``) a compute node may lack; a run must not
    train to its end and fail there."""
    try:
        tokenizer.decode([0])
    except DataError as e:
        raise DataError(f"the run's end samples text (--train.sample_tokens), which needs "
                        f"the tokenizer: {e} (or pass --train.sample_tokens=0)") from None


class BatchLoader:
    """This rank's rows of each global batch, as (inputs, targets) on ``device`` (the
    rank's device layer, ``comm/device.py``: pinned and copied without blocking on a GPU).

    The training sampler is a pure function of the step, so step s+1's read is queued in
    the reader thread while step s computes. Evaluation batches use fixed random windows
    (the same every time) or every window of the split. ``dp_index`` of ``dp`` replicas:
    every stage of a pipeline replica reads the same rows. ``parts`` of ``n_parts``: the
    equal pieces of each row this rank reads, in that order (context parallelism: a
    rank's two chunks, ``parallel/context/chunks.py``), and nothing else of the row."""

    def __init__(self, data: Prefetcher, *, block: int, batch_size: int, seed: int,
                 sampler: str, max_steps: int, dp_index: int, dp: int,
                 device: Accelerator, prefetch: bool = True,
                 parts: tuple[int, ...] = (0,), n_parts: int = 1):
        """``prefetch``: the configuration asked to read ahead (``--data.prefetch``)."""
        self.data, self.block, self.device, self.prefetch = data, block, device, prefetch
        if block % n_parts or not all(0 <= p < n_parts for p in parts):
            raise ValueError(f"parts {parts} of {n_parts} do not cut rows of {block} tokens")
        self.parts, self.part_size = np.array(parts, dtype=np.int64), block // n_parts
        self.dp_index, self.dp, self.max_steps = dp_index, dp, max_steps
        self.sampler = make_sampler(sampler, data.splits["train"].n_tokens, block,
                                    batch_size, seed)
        self.eval_sampler = make_sampler("random", data.splits["val"].n_tokens, block,
                                         batch_size, seed, stream=EVAL_STREAM)
        self._next = None  # (step, read in flight) of the next training batch
        self.tokenizer, self.vocab_size = data.tokenizer, data.vocab_size

    @classmethod
    def open(cls, cfg, world, *, dp_index: int, dp: int, device: Accelerator,
             parts: tuple[tuple[int, ...], int] = ((0,), 1)) -> BatchLoader:
        """The run's data (``cfg``: the whole ``Config``), checked against the model and,
        with ``--data.verify``, against its checksums; ``parts``: (which pieces of each
        row, of how many) this rank reads. Collective."""
        data = open_dataset(cfg.data, world)
        try:
            data.check_fits(cfg.model.block_size, cfg.model.vocab_size)
            if cfg.train.sample_tokens > 0:
                check_can_decode(data.tokenizer)
            if cfg.data.verify:
                verify_dataset(data, world, local_copy=bool(cfg.data.local_copy_dir))
        except BaseException:
            data.close()
            raise
        t = cfg.train
        return cls(data, block=cfg.model.block_size, batch_size=t.batch_size, seed=t.seed,
                   sampler=cfg.data.sampler, max_steps=t.max_iters, dp_index=dp_index, dp=dp,
                   device=device, prefetch=cfg.data.prefetch, parts=parts[0],
                   n_parts=parts[1])

    def describe(self) -> str:
        """One line for the start-up log: the reader (``mpiio.describe_reader``) and,
        where prefetching was asked for but reads stay in the main thread, why."""
        return describe_reader(self.data.reader) + thread_note(
            self.prefetch, self.data.threaded, MPI.Query_thread())

    def train(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s rows, read while the previous step computed; the next step's
        read is queued now."""
        pending, self._next = self._next, None
        if pending is None or pending[0] != step:  # the first step, or a resumed one
            pending = (step, self.data.submit(self._load_train, step))
        if step + 1 < self.max_steps:
            self._next = (step + 1, self.data.submit(self._load_train, step + 1))
        return self._to_device(*self.data.wait(pending[1], "the training batch"))

    def val(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k``-th fixed batch of the periodic validation estimate."""
        return self.rows("val", self.eval_sampler.local_starts(k, self.dp_index, self.dp))

    def val_windows(self, most: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
        """(the non-overlapping windows of the validation split to evaluate, this
        replica's share of them, how many the split has). ``most`` > 0 keeps at most that
        many, evenly spaced over the split (a sorted corpus's tail is not a sample)."""
        starts = all_windows(self.data.splits["val"].n_tokens, self.block)
        every = len(starts)
        if 0 < most < every:
            starts = starts[np.linspace(0, every - 1, most).round().astype(np.int64)]
        return starts, np.array_split(starts, self.dp)[self.dp_index], every

    def rows(self, split: str, starts) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.data.submit(self._load, split, np.array(starts, dtype=np.int64))
        return self._to_device(*self.data.wait(rows, f"reading {split} data"))

    def _load_train(self, step: int):
        # In the reader thread, the only user of self.sampler. Every rank reads as many
        # rows, so the collective reads need not agree on a count first.
        return self._load("train", self.sampler.local_starts(step, self.dp_index, self.dp),
                          uniform=True)

    def _load(self, split: str, starts: np.ndarray, uniform: bool = False):
        """(inputs, targets) of this rank's parts of the windows at ``starts``: each part
        is read as its own window of part_size + 1 tokens (its inputs and targets), so
        a rank reads only the tokens it computes on (and one more per part)."""
        size, n = self.part_size, len(self.parts)
        piece_starts = (starts[:, None] + self.parts[None, :] * size).reshape(-1)
        tokens = self.data.reader.read(split, piece_starts, size + 1, uniform=uniform)
        check_token_ids(tokens, self.vocab_size, self.data.path, split)
        tokens = torch.from_numpy(tokens).reshape(len(starts), n, size + 1)
        return (tokens[..., :-1].reshape(len(starts), n * size).contiguous(),
                tokens[..., 1:].reshape(len(starts), n * size).contiguous())

    def _to_device(self, x: torch.Tensor, y: torch.Tensor):
        return self.device.to_device(x), self.device.to_device(y)

    def close(self) -> None:
        self.data.close()
