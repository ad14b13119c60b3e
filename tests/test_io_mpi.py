"""The data path over real MPI ranks (run under ``mpiexec -n 2`` and ``-n 4``): collective
MPI-IO reads against numpy, manifests, uneven read counts with aggregation on, the
sampler across world sizes and restarts, parallel preparation byte for byte, the node-local copy,
a 2 GB file with bounded memory, and corrupt inputs failing every rank the same way."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import DataConfig
from hpctrain.data.corpus import stdlib_files
from hpctrain.data.dataset import TokenDataset, read_info
from hpctrain.data.loader import agree, open_dataset
from hpctrain.data.mpiio import MPIIODataset
from hpctrain.data.prepare import assign_files, combine, prepare
from hpctrain.errors import DataError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config
from tests.test_io import _corrupt, make_big_sparse_file, numpy_windows, read_all_bounded

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _on_root(fn):
    """Run ``fn`` on rank 0 and give every rank its result."""
    return COMM.bcast(fn() if COMM.rank == 0 else None, root=0)


@pytest.mark.parametrize("hints", [{}, {"romio_cb_read": "enable", "cb_buffer_size": "65536"}])
def test_collective_reads_equal_numpy_with_uneven_counts(mpi_dataset, hints):
    info = read_info(mpi_dataset)
    rng = np.random.default_rng(COMM.rank)
    with MPIIODataset(info, COMM, hints=hints) as reader:
        for split in ("train", "val"):
            n = info.splits[split].n_tokens
            for count in (16, 3 * COMM.rank, 0):  # equal, uneven (none on rank 0), none
                starts = rng.integers(0, n - 129, count)
                got = reader.read(split, starts, 129, uniform=count == 16)
                assert np.array_equal(got, numpy_windows(mpi_dataset, info, split, starts, 129))


def test_manifest_reads_across_shards_on_every_rank(shared_tmp):
    from pathlib import Path

    def make():
        paths = []
        for i, n in enumerate((2000, 1500, 900)):
            text = bytes(np.random.default_rng(i).integers(32, 127, n, dtype=np.uint8))
            (Path(shared_tmp) / f"s{i}.txt").write_bytes(text)
            paths.append(prepare([Path(shared_tmp) / f"s{i}.txt"], Path(shared_tmp) / f"s{i}.h5",
                                 tokenizer="byte", show_progress=False)["output"])
        return combine(paths, Path(shared_tmp) / "all.json")["output"]
    manifest = _on_root(make)
    ref = TokenDataset(manifest)
    rng = np.random.default_rng(10 + COMM.rank)
    with MPIIODataset(read_info(manifest), COMM) as reader:
        for count in (8, COMM.rank + 1):
            starts = rng.integers(0, ref.splits["train"].n_tokens - 300, count)
            starts[0] = 1790 + COMM.rank  # crosses from the first shard into the second
            assert np.array_equal(reader.read("train", starts, 300, uniform=count == 8),
                                  ref.read("train", starts, 300))
        assert reader.verify(COMM.rank, COMM.size) == []


def test_sampler_batches_are_world_size_invariant_and_resumable(mpi_dataset, shared_tmp):
    """Each rank's rows, gathered, are the single-process global batch; a trainer started
    at step 7 (a resumed run) reads exactly what one that walked there read."""
    def cfg_in(sub):
        return tiny_config(mpi_dataset, f"{shared_tmp}/{sub}",
                           **{"train.batch_size": 8, "train.max_iters": 10})
    cfg = cfg_in("walked")
    walked = Trainer(cfg, cpu_world(COMM), verbose=False)
    batches = [walked.batches.train(s) for s in range(10)]
    resumed = Trainer(cfg_in("resumed"), cpu_world(COMM), verbose=False)
    for step in (7, 8, 9):
        x, y = resumed.batches.train(step)
        assert torch_equal(x, batches[step][0]) and torch_equal(y, batches[step][1])
    ref = TokenDataset(mpi_dataset)
    for step in (0, 5, 9):
        rows = np.concatenate(COMM.allgather(batches[step][0].numpy()))
        tokens = ref.read("train", walked.batches.sampler.global_starts(step), cfg.model.block_size + 1)
        assert np.array_equal(rows, tokens[:, :-1])


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


@pytest.mark.parametrize("reader", ["mpiio", "mmap"])
def test_training_is_the_same_with_every_reader(mpi_dataset, shared_tmp, reader):
    cfg = tiny_config(mpi_dataset, shared_tmp, **{"data.reader": reader, "train.max_iters": 8,
                                                  "data.prefetch": reader == "mpiio"})
    losses = Trainer(cfg, cpu_world(COMM), verbose=False).fit().losses
    ref = Trainer(tiny_config(mpi_dataset, f"{shared_tmp}/ref", **{"data.reader": "mmap",
                                                           "data.prefetch": False,
                                                           "train.max_iters": 8}),
                  cpu_world(COMM), verbose=False).fit().losses
    assert losses == ref


@pytest.mark.parametrize("tokenizer", ["char", "byte"])
def test_parallel_preparation_writes_the_single_process_bytes(shared_tmp, tokenizer):
    from pathlib import Path

    files = stdlib_files(600_000)
    serial = _on_root(lambda: prepare(files, Path(shared_tmp) / "serial.h5",
                                      tokenizer=tokenizer, show_progress=False)["output"])
    out = prepare(files, Path(shared_tmp) / "parallel.h5", tokenizer=tokenizer,
                  show_progress=False, comm=COMM)
    assert out["ranks"] == COMM.size
    if COMM.rank == 0:
        assert Path(out["output"]).read_bytes() == Path(serial).read_bytes()
        assert not [p for p in Path(shared_tmp).iterdir() if p.name.endswith(".tmp")]
        # The comparison above catches a split that depends on the rank count (e.g. each
        # rank choosing from its own files) only if several ranks hold validation files.
        with h5py.File(serial) as f:
            per_file = f["source_tokens"][()]
        runs = assign_files([p.stat().st_size for p in files], COMM.size)
        assert sum(per_file[lo:hi, 1].sum() > 0 for lo, hi in runs) >= 2


def test_a_bad_file_on_one_rank_fails_every_rank_and_writes_nothing(shared_tmp):
    from pathlib import Path

    corpus = Path(shared_tmp) / "corpus"

    def make():
        corpus.mkdir()
        for i in range(COMM.size * 2):
            (corpus / f"{i:02d}.txt").write_text(f"text number {i}\n" * 100)
        (corpus / "99-last.txt").write_bytes(b"\xff\xfe not utf-8")  # the last rank's
    _on_root(make)
    with pytest.raises(DataError, match="99-last.txt is not UTF-8"):
        prepare([corpus], Path(shared_tmp) / "out" / "d.h5", show_progress=False, comm=COMM)
    COMM.Barrier()
    assert not (Path(shared_tmp) / "out").exists() or not list((Path(shared_tmp) / "out").iterdir())


def test_local_copy_made_once_per_node_and_read(mpi_dataset, shared_tmp):
    local_dir = f"{shared_tmp}/local-scratch"
    world = cpu_world(COMM)
    data = open_dataset(DataConfig(path=mpi_dataset, local_copy_dir=local_dir), world)
    try:
        assert str(data.reader.info.files[0]).startswith(local_dir)
        starts = np.random.default_rng(COMM.rank).integers(0, 1000, 5)
        assert np.array_equal(data.read("train", starts, 40),
                              TokenDataset(mpi_dataset).read("train", starts, 40))
        assert data.verify(world.local_rank, world.local_size) == []
    finally:
        data.close()


def test_one_ranks_failure_fails_every_rank_with_its_message():
    def fn():
        if COMM.rank == COMM.size - 1:
            raise DataError("the last rank's disk is full")
        return COMM.rank
    with pytest.raises(DataError, match="the last rank's disk is full"):
        agree(COMM, fn, timeout=30, what="test")


@pytest.mark.parametrize("kind, message", [
    ("truncated", "is truncated|not a readable HDF5 file"),
    ("magic", "not an hpctrain token file"),
    ("version", "format version 99"),
    ("checksum table", "checksums of train disagree"),
    ("flipped byte", "fail their CRC-32 check"),
])
def test_corrupt_files_fail_every_rank_the_same_way(mpi_dataset, shared_tmp, kind, message):
    from pathlib import Path

    bad = _on_root(lambda: str(_corrupt(kind, Path(mpi_dataset), Path(shared_tmp) / "bad.h5")))
    with pytest.raises(DataError, match=message):
        Trainer(tiny_config(bad, shared_tmp), cpu_world(COMM), verbose=False)


def test_data_that_does_not_fit_the_model_fails_every_rank(mpi_dataset, shared_tmp):
    info = read_info(mpi_dataset)
    with pytest.raises(DataError, match=f"--model.vocab_size={info.vocab_size}"):
        Trainer(tiny_config(mpi_dataset, shared_tmp, **{"model.vocab_size": info.vocab_size - 1}),
                cpu_world(COMM), verbose=False)
    with pytest.raises(DataError, match="lower the block size"):
        Trainer(tiny_config(mpi_dataset, shared_tmp,
                            **{"model.block_size": info.splits["val"].n_tokens}),
                cpu_world(COMM), verbose=False)


@pytest.mark.slow
def test_a_2gb_dataset_is_read_with_bounded_memory(shared_tmp):
    from pathlib import Path

    path, windows = _on_root(lambda: make_big_sparse_file(Path(shared_tmp) / "big.h5"))
    try:
        mine = np.array_split(windows, COMM.size)[COMM.rank][:48]
        growth = read_all_bounded(path, mine, COMM)
        assert growth < 200, f"rank {COMM.rank}: memory grew by {growth:.0f} MB"
    finally:
        COMM.Barrier()
        if COMM.rank == 0:
            path.unlink()
