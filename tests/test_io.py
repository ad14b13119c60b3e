"""The data path in one process: format version 2 and manifests, checksums, MPI-IO reads
on one rank against numpy, parallel preparation's pieces, tokenizers, the node-local copy, the
prefetching thread, and every corrupt input through the trainer."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import types
import zlib

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.config import ConfigError, DataConfig, load_config, parse_hints
from hpctrain.data.dataset import TokenDataset, read_info
from hpctrain.data.format import (CHECKSUM_BLOCK_BYTES, block_crcs, checksum_from_blocks,
                                  crc32_combine, write_token_file)
from hpctrain.data.loader import open_dataset
from hpctrain.data.mpiio import MPIIODataset
from hpctrain.data.prefetch import Prefetcher
from hpctrain.data.prepare import (assign_files, combine, crc_pieces, join_crc_pieces,
                                   prepare)
from hpctrain.data.local_copy import local_copy_paths, make_local_copy
from hpctrain.data.tokenizers import GPT2Tokenizer, _GPT2_URLS, _cache_file
from hpctrain.errors import CommTimeout, DataError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

# ------------------------------------------------------------- helpers (also for MPI tests)


def numpy_windows(path, info, split, starts, length) -> np.ndarray:
    """The reference read: ``np.fromfile`` at each window's byte offset (one-file datasets)."""
    s = info.splits[split]
    rows = [np.fromfile(path, dtype=s.dtype, count=length,
                        offset=s.offset + int(st) * s.dtype.itemsize) for st in starts]
    return np.array(rows, dtype=np.int64).reshape(len(rows), length)


def write_v1_file(path, train, val):
    """A token file as hpctrain's format version 1 wrote it (h5py's default layout)."""
    chars = "".join(chr(32 + i) for i in range(64))
    with h5py.File(path, "w", libver="latest") as f:
        f.attrs.update({"magic": "hpctrain-tokens", "format_version": 1, "vocab_size": 64,
                        "tokenizer": json.dumps({"name": "char", "vocab_size": 64,
                                                 "chars": chars}),
                        "created_by": "hpctrain 0.1.0"})
        for name, arr in (("train", train), ("val", val)):
            f.create_dataset(name, data=arr)
            f.create_dataset(f"crc32/{name}", data=block_crcs(arr))
            f[f"crc32/{name}"].attrs["block_bytes"] = CHECKSUM_BLOCK_BYTES
        f.create_dataset("sources", data="[]")
    return path


class rss_growth_mb:
    """Peak resident memory over a ``with`` block, in MB above the memory at its start
    (the kernel's high-water mark, reset through /proc/self/clear_refs)."""

    @staticmethod
    def _kb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field))

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start = self._kb("VmRSS:")
        return self

    def __exit__(self, *exc):
        self.mb = (self._kb("VmHWM:") - self.start) / 1024


BIG_TRAIN, PATCH = 1_000_000_000, 1 << 17  # 2 GB of uint16 tokens; known tokens per block


def read_all_bounded(path, windows, comm) -> float:
    """Read ``windows`` (16 per call) through MPI-IO on ``comm``, check each against numpy,
    verify the file's checksums; return this rank's peak memory growth in MB."""
    info = read_info(path)
    with rss_growth_mb() as growth:
        data = open_dataset(DataConfig(path=str(path), reader="mpiio"), cpu_world(comm))
        assert data.verify(comm.rank, comm.size) == []
        for k in range(0, len(windows), 16):
            got = data.read("train", windows[k:k + 16], 1025, uniform=True)
            assert np.array_equal(got, numpy_windows(path, info, "train", windows[k:k + 16],
                                                     1025))
        data.close()
    return growth.mb


def make_big_sparse_file(path, n_windows: int = 256, seed: int = 0):
    """A valid ~2 GB token file in a few seconds: the arrays are allocated but unwritten
    (a sparse file that reads as zeros) except for a patch of known tokens in every
    checksum block; the checksums are zlib's over the same bytes. Returns the path and
    window starts, half inside patches, half anywhere."""
    from hpctrain.data.format import create_token_file

    block_tokens = CHECKSUM_BLOCK_BYTES // 2
    n_blocks = -(-BIG_TRAIN // block_tokens)
    buf = np.zeros(block_tokens, np.uint16)
    patches, crcs = [], []
    for b in range(n_blocks):
        length = min(block_tokens, BIG_TRAIN - b * block_tokens)
        at = (b * 7919 * 64) % (length - PATCH)
        tokens = ((np.arange(PATCH, dtype=np.uint64) * (b + 1) * 2654435761 >> 9) % 50000
                  ).astype(np.uint16)
        buf[at:at + PATCH] = tokens
        crcs.append(zlib.crc32(buf[:length]))
        buf[at:at + PATCH] = 0
        patches.append((b * block_tokens + at, tokens))
    del buf
    n_val = 100_000
    offsets = create_token_file(
        path, n_tokens={"train": BIG_TRAIN, "val": n_val}, dtype=np.dtype("<u2"),
        tokenizer_meta={"name": "gpt2", "vocab_size": 50257}, sources=[],
        crcs={"train": np.array(crcs, np.uint32),
              "val": np.array([zlib.crc32(bytes(2 * n_val))], np.uint32)})
    with open(path, "r+b") as f:
        for start, tokens in patches:
            f.seek(offsets["train"] + 2 * start)
            f.write(tokens.tobytes())
    rng = np.random.default_rng(seed)
    inside = [start + int(rng.integers(0, PATCH - 1025)) for start, _ in patches]
    inside = rng.choice(inside, n_windows // 2)
    anywhere = rng.integers(0, BIG_TRAIN - 1025, n_windows - len(inside))
    return path, rng.permutation(np.concatenate([inside, anywhere])).astype(np.int64)


# ------------------------------------------------------------------ checksums, layout

def test_crc32_combine_equals_zlib_on_the_concatenation():
    rng = np.random.default_rng(0)
    for n1, n2 in [(0, 5), (5, 0), (1, 1), (1000, 12345), (70000, 3)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = rng.bytes(1_000_003)
    assert checksum_from_blocks(block_crcs(np.frombuffer(data, np.uint8), 4096), len(data),
                                4096) == zlib.crc32(data)


def test_checksum_pieces_from_any_cut_equal_the_blocks():
    data = np.random.default_rng(1).integers(0, 255, 10_000, dtype=np.uint8)
    for cuts in ([0, 10_000], [0, 1, 999, 1000, 5555, 10_000], [0, 2500, 5000, 7500, 10_000]):
        pieces = [p for a, b in zip(cuts, cuts[1:])
                  for p in crc_pieces(memoryview(data[a:b]), a, block_bytes=1000)]
        assert np.array_equal(join_crc_pieces(pieces, data.size, 1000), block_crcs(data, 1000))
    assert join_crc_pieces([], 0, 1000).tolist() == block_crcs(np.zeros(0, np.uint8)).tolist()


def test_files_are_split_into_contiguous_runs_of_similar_size():
    sizes = [100, 5, 5, 300, 50, 50, 200, 90]
    for n in (1, 2, 3, 4, 8, 12):
        runs = assign_files(sizes, n)
        assert len(runs) == n and runs[0][0] == 0 and runs[-1][1] == len(sizes)
        assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))  # contiguous, no gaps
    loads = [sum(sizes[a:b]) for a, b in assign_files(sizes, 2)]
    assert max(loads) <= 0.6 * sum(sizes)
    assert assign_files([0, 0], 3) == [(0, 2), (2, 2), (2, 2)]


def test_version_2_file_layout(tmp_path):
    tokens = np.arange(5000, dtype=np.uint16) % 70
    path = write_token_file(tmp_path / "d.h5", {"train": tokens[:4000], "val": tokens[4000:]},
                            {"name": "byte", "vocab_size": 256}, ["x.txt"])
    with h5py.File(path) as f:
        assert f.attrs["format_version"] == 2
        for name, arr in (("train", tokens[:4000]), ("val", tokens[4000:])):
            d = f[name]
            assert d.chunks is None and d.compression is None and d.dtype == np.dtype("<u2")
            assert d.attrs["n_tokens"] == arr.size and d.attrs["crc32"] == zlib.crc32(arr.tobytes())
            assert f[f"crc32/{name}"].attrs["block_bytes"] == CHECKSUM_BLOCK_BYTES
    info = read_info(path)
    assert numpy_windows(path, info, "val", [0, 990], 10).tolist() == \
        [tokens[4000:4010].tolist(), tokens[4990:5000].tolist()]


def test_version_1_files_are_still_read(tmp_path):
    tokens = (np.arange(3000) % 50).astype(np.uint16)
    path = write_v1_file(tmp_path / "old.h5", tokens[:2700], tokens[2700:])
    ds = TokenDataset(path)
    assert ds.read("train", np.array([5]), 4)[0].tolist() == tokens[5:9].tolist()
    assert ds.verify() == []


def test_preparation_is_deterministic_and_one_rank_mpi_writes_the_same_bytes(dataset_path,
                                                                              tmp_path):
    from hpctrain.data.corpus import stdlib_files

    files = stdlib_files(300_000)
    a = prepare(files, tmp_path / "a.h5", show_progress=False)["output"]
    b = prepare(files, tmp_path / "b.h5", show_progress=False, comm=MPI.COMM_SELF)["output"]
    assert open(a, "rb").read() == open(b, "rb").read() == dataset_path.read_bytes()


def test_a_failed_preparation_leaves_nothing_behind(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("fine text\n" * 10)
    (tmp_path / "in" / "b.txt").write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(DataError, match="is not UTF-8 text.*--tokenizer byte"):
        prepare([tmp_path / "in"], tmp_path / "out" / "d.h5", show_progress=False)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


# ------------------------------------------------------------------------ manifests

@pytest.fixture
def shards(tmp_path):
    """Two byte-level shards and the concatenations of their splits."""
    rng = np.random.default_rng(7)
    paths, train, val = [], [], []
    for i, n in enumerate((3000, 1700)):
        data = rng.integers(32, 127, n, dtype=np.uint8).tobytes()
        (tmp_path / f"s{i}.txt").write_bytes(data)
        paths.append(prepare([tmp_path / f"s{i}.txt"], tmp_path / f"s{i}.h5", tokenizer="byte",
                             show_progress=False)["output"])
        n_train = int(n * 0.9)
        train.append(np.frombuffer(data, np.uint8)[:n_train])
        val.append(np.frombuffer(data, np.uint8)[n_train:])
    return paths, np.concatenate(train).astype(np.int64), np.concatenate(val).astype(np.int64)


def test_a_manifest_reads_as_one_dataset_across_shard_boundaries(shards, tmp_path):
    paths, train, val = shards
    summary = combine(paths, tmp_path / "all.json")
    assert summary["shards"] == 2 and summary["train_tokens"] == train.size
    starts = np.array([0, 2690, 2695, 2699, train.size - 20])  # some cross from shard 0 to 1
    for reader in (TokenDataset(tmp_path / "all.json"),
                   MPIIODataset(read_info(tmp_path / "all.json"), MPI.COMM_SELF)):
        with reader:
            assert reader.splits["train"].n_tokens == train.size
            got = reader.read("train", starts, 20)
            assert np.array_equal(got, np.stack([train[s:s + 20] for s in starts]))
            assert np.array_equal(reader.read("val", [295, 0], 10),
                                  np.stack([val[295:305], val[0:10]]))
            assert reader.verify() == []


def test_manifest_problems_name_the_fix(shards, tmp_path):
    paths, _, _ = shards
    manifest = tmp_path / "all.json"
    combine(paths, manifest)
    doc = json.loads(manifest.read_text())
    doc["shards"][1]["train_tokens"] += 1
    manifest.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="does not match .*replaced or damaged"):
        read_info(manifest)
    combine(paths, manifest, overwrite=True)
    os.unlink(paths[1])
    with pytest.raises(DataError, match="lists shard s1.h5, which does not exist"):
        read_info(manifest)
    with pytest.raises(DataError, match="ends in .json"):
        combine(paths[:1], tmp_path / "x.h5")
    char = prepare([tmp_path / "s0.txt"], tmp_path / "c.h5", show_progress=False)["output"]
    with pytest.raises(DataError, match="different vocabularies"):
        combine([paths[0], char], tmp_path / "y.json")


# ------------------------------------------------------------- MPI-IO on one rank

def test_mpiio_reads_equal_a_numpy_reference(dataset_path):
    info = read_info(dataset_path)
    rng = np.random.default_rng(3)
    with MPIIODataset(info, MPI.COMM_SELF) as reader:
        for split in ("train", "val"):
            n = info.splits[split].n_tokens
            for count in (0, 1, 16):
                starts = rng.integers(0, n - 65, count)
                got = reader.read(split, starts, 65, uniform=count == 16)
                assert got.dtype == np.int64 and got.shape == (count, 65)
                assert np.array_equal(got, numpy_windows(dataset_path, info, split, starts, 65))
        with pytest.raises(ValueError, match="do not fit"):
            reader.read("val", [info.splits["val"].n_tokens - 3], 4)


def test_romio_hints_are_parsed_and_checked():
    assert parse_hints(" striping_factor=8, romio_cb_read=enable ,") == \
        {"striping_factor": "8", "romio_cb_read": "enable"}
    assert parse_hints("") == {}
    for bad in ("striping_factor", "a b=1", "x="):
        with pytest.raises(ConfigError, match="key=value"):
            parse_hints(bad)
    with pytest.raises(ConfigError, match="data.romio_hints"):
        load_config("default", ["--data.romio_hints=cb_nodes"])


@pytest.mark.parametrize("reader", ["mpiio", "mmap"])
def test_open_dataset_picks_the_reader_and_prefetches(dataset_path, reader):
    data = open_dataset(DataConfig(path=str(dataset_path), reader=reader),
                        cpu_world(MPI.COMM_SELF))
    try:
        assert type(data.reader).__name__ == {"mpiio": "MPIIODataset", "mmap": "TokenDataset"}[reader]
        assert data.threaded
        ref = TokenDataset(dataset_path).read("train", [3, 500], 33)
        assert np.array_equal(data.read("train", [3, 500], 33), ref)
        assert data.vocab_size == TokenDataset(dataset_path).vocab_size
    finally:
        data.close()


def test_h5mpio_reader_where_h5py_has_mpi_and_a_clear_error_elsewhere(dataset_path):
    from hpctrain.data.loader import resolve_reader
    from hpctrain.data.mpiio import h5py_has_mpi

    cfg = DataConfig(path=str(dataset_path), reader="h5mpio")
    world = cpu_world(MPI.COMM_SELF)
    if not h5py_has_mpi():
        assert resolve_reader("auto") == "mpiio"
        with pytest.raises(DataError, match="needs h5py built with MPI.*--data.reader=mpiio"):
            open_dataset(cfg, world)
        return
    assert resolve_reader("auto") == "h5mpio"
    data = open_dataset(cfg, world)
    try:
        info = read_info(dataset_path)
        starts = np.array([0, 17, 4000])
        assert np.array_equal(data.read("train", starts, 50),
                              numpy_windows(dataset_path, info, "train", starts, 50))
    finally:
        data.close()


# ------------------------------------------------------------------ prefetch thread

def test_prefetcher_runs_reads_in_submission_order_and_keeps_deadlines():
    class Slow:
        def __init__(self):
            self.order, self.thread = [], None

        def read(self, split, starts, length):
            time.sleep(0.02 if split == "train" else 0.0)
            self.order.append(split)
            self.thread = threading.current_thread().name
            return np.zeros((len(starts), length))

        def close(self):
            pass

    reader = Slow()
    p = Prefetcher(reader, timeout=5.0)
    first = p.submit(reader.read, "train", [1], 3)
    assert p.read("val", [1, 2], 3).shape == (2, 3)  # queued behind the prefetch
    assert reader.order == ["train", "val"] and p.wait(first).shape == (1, 3)
    assert reader.thread.startswith("hpctrain-reader")
    p.timeout = 0.001
    with pytest.raises(CommTimeout, match="did not complete within"):
        p.wait(p.submit(time.sleep, 0.2), "a slow read")
    p.timeout = 5.0
    with pytest.raises(ZeroDivisionError):
        p.wait(p.submit(lambda: 1 / 0))
    p.close()
    inline = Prefetcher(Slow(), timeout=1.0, threaded=False)
    assert inline.read("val", [0], 2).shape == (1, 2) and inline.reader.thread == \
        threading.current_thread().name


# ------------------------------------------------------------------------ tokenizers

def test_gpt2_without_tiktoken_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import fails
    with pytest.raises(DataError, match="needs the tiktoken package: `pip install tiktoken`"):
        GPT2Tokenizer().encode("hi")


@pytest.fixture
def fake_tiktoken(monkeypatch, tmp_path):
    """tiktoken stand-in (byte-level ids) so that the cache lookup runs offline."""
    calls = []
    enc = types.SimpleNamespace(encode_ordinary=lambda t: list(t.encode()),
                                decode=lambda ids: bytes(ids).decode())
    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(
        get_encoding=lambda name: calls.append(name) or enc))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def test_gpt2_without_the_encoding_file_says_how_to_fetch_it_offline(fake_tiktoken, tmp_path):
    with pytest.raises(DataError) as err:
        GPT2Tokenizer().encode("hi")
    msg = str(err.value)
    assert "hpctrain never downloads" in msg and "TIKTOKEN_CACHE_DIR" in msg
    assert _GPT2_URLS["r50k_base"][0] in msg and str(tmp_path / "cache") in msg
    assert fake_tiktoken == []  # never asked tiktoken (which would try to download)


def test_gpt2_loads_from_the_local_cache_and_prepares(fake_tiktoken, tmp_path):
    url = _GPT2_URLS["r50k_base"][0]
    _cache_file(url).parent.mkdir(parents=True)
    _cache_file(url).write_bytes(b"cached")
    tok = GPT2Tokenizer()
    assert tok.encode("ab").tolist() == [97, 98] and tok.decode([104, 105]) == "hi"
    assert fake_tiktoken == ["r50k_base"]
    (tmp_path / "t.txt").write_text("hello world\n" * 40)
    s = prepare([tmp_path / "t.txt"], tmp_path / "g.h5", tokenizer="gpt2", show_progress=False)
    info = read_info(s["output"])
    assert info.tokenizer_meta == {"name": "gpt2", "vocab_size": 50257}
    assert info.splits["train"].dtype == np.uint16


# GPT-2's real ranks: tests/test_gpt2_bpe.py, in the hf leg (make test-hf).


# -------------------------------------------------------------------- node-local copy

def test_local_copy_copies_once_and_reuses_the_copy(dataset_path, tmp_path):
    info = read_info(dataset_path)
    local_dir = tmp_path / "local"
    dests = make_local_copy(info, local_dir)
    assert dests == local_copy_paths(info, local_dir)
    assert dests[0].read_bytes() == dataset_path.read_bytes()
    mtime = dests[0].stat().st_mtime_ns
    time.sleep(0.01)
    assert make_local_copy(info, local_dir) == dests and dests[0].stat().st_mtime_ns == mtime
    data = open_dataset(DataConfig(path=str(dataset_path), local_copy_dir=str(local_dir)),
                        cpu_world(MPI.COMM_SELF))
    try:
        assert data.reader.info.files == tuple(dests)
        assert np.array_equal(data.read("val", [7], 9), TokenDataset(dataset_path).read("val", [7], 9))
    finally:
        data.close()


def test_local_copy_without_space_names_the_fix(dataset_path, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: types.SimpleNamespace(free=10))
    with pytest.raises(DataError, match="GB free, the dataset needs"):
        make_local_copy(read_info(dataset_path), tmp_path / "local")
    assert not list((tmp_path / "local").iterdir())


# ---------------------------------------------------- corrupt inputs, through training

def _corrupt(kind, src, dst):
    dst.write_bytes(src.read_bytes())
    if kind == "truncated":
        dst.write_bytes(src.read_bytes()[: src.stat().st_size - 100])
    elif kind == "not hdf5":
        dst.write_bytes(b"hello, not a token file")
    elif kind in ("magic", "version", "checksum table"):
        with h5py.File(dst, "a") as f:
            if kind == "magic":
                f.attrs["magic"] = "something-else"
            elif kind == "version":
                f.attrs["format_version"] = 99
            else:
                f["train"].attrs.modify("crc32", np.uint32(f["train"].attrs["crc32"] ^ 1))
    elif kind == "flipped byte":
        offset = read_info(dst).splits["val"].offset
        raw = bytearray(dst.read_bytes())
        raw[offset + 10] ^= 0xFF
        dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("kind, message", [
    ("truncated", "is truncated|not a readable HDF5 file"),
    ("not hdf5", "not a readable HDF5 file"),
    ("magic", "not an hpctrain token file"),
    ("version", "format version 99, this hpctrain reads version"),
    ("checksum table", "checksums of train disagree"),
    ("flipped byte", "fail their CRC-32 check \\(val block 0\\).*re-create"),
])
def test_corrupt_files_stop_training_with_one_message(dataset_path, tmp_path, kind, message):
    bad = _corrupt(kind, dataset_path, tmp_path / "bad.h5")
    cfg = tiny_config(bad, tmp_path / "out")
    with pytest.raises(DataError, match=message):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)


def test_data_that_does_not_fit_the_model_stops_training(dataset_path, tmp_path):
    vocab = read_info(dataset_path).vocab_size
    with pytest.raises(DataError, match=f"--model.vocab_size={vocab}"):
        Trainer(tiny_config(dataset_path, tmp_path, **{"model.vocab_size": vocab - 1}),
                cpu_world(MPI.COMM_SELF), verbose=False)
    n_val = read_info(dataset_path).splits["val"].n_tokens
    with pytest.raises(DataError, match="lower the block size"):
        Trainer(tiny_config(dataset_path, tmp_path, **{"model.block_size": n_val}),
                cpu_world(MPI.COMM_SELF), verbose=False)


def test_token_ids_outside_the_vocabulary_stop_training_with_one_message(dataset_path,
                                                                        tmp_path):
    """Checksums that agree with ids the vocabulary lacks (another tool's file): a
    DataError at the first read, not an IndexError in the embedding steps later."""
    bad = tmp_path / "bad.h5"
    bad.write_bytes(dataset_path.read_bytes())
    train = read_info(bad).splits["train"]
    raw = bytearray(bad.read_bytes())
    width = train.dtype.itemsize * train.n_tokens
    raw[train.offset:train.offset + width] = b"\xff" * width
    bad.write_bytes(bytes(raw))
    cfg = tiny_config(bad, tmp_path / "out", **{"data.verify": False})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    top = np.iinfo(train.dtype).max
    with pytest.raises(DataError, match=f"token id {top}, outside its vocabulary of "
                                        f"{read_info(bad).vocab_size}.*prepare it again"):
        trainer.fit()


# --------------------------------------------------------------- a 2 GB file, 1 rank

@pytest.mark.slow
def test_a_2gb_dataset_is_read_with_bounded_memory(tmp_path):
    path, windows = make_big_sparse_file(tmp_path / "big.h5")
    try:
        growth = read_all_bounded(path, windows, MPI.COMM_SELF)
        assert growth < 200, f"memory grew by {growth:.0f} MB"
    finally:
        path.unlink()


# ------------------------------------------------------------- the command line, N ranks

@pytest.mark.slow
def test_prepare_under_mpiexec_writes_what_one_process_writes(tmp_path):
    from tests.helpers import hpctrain_cmd, mpiexec, run

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"file {i}: " + "all work and no play " * (50 * i + 1))
    p = run(mpiexec(2, *hpctrain_cmd("prepare", "--input", str(corpus), "--output",
                                     str(tmp_path / "two.h5"))))
    assert p.returncode == 0, p.stderr
    assert "2 rank(s)" in p.stdout and "tokenize (rank 0 of 2)" in p.stderr
    p = run(hpctrain_cmd("prepare", "--input", str(corpus), "--output", str(tmp_path / "one.h5")))
    assert p.returncode == 0 and "1 rank(s)" in p.stdout, p.stderr
    assert (tmp_path / "one.h5").read_bytes() == (tmp_path / "two.h5").read_bytes()
    p = run(mpiexec(2, *hpctrain_cmd("prepare", "--input", str(corpus), "--output",
                                     str(tmp_path / "g.h5"), "--tokenizer", "gpt2")),
            env={"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty")})
    assert p.returncode != 0 and not (tmp_path / "g.h5").exists()
    assert len([line for line in p.stderr.splitlines() if "error:" in line]) == 1, p.stderr


@pytest.mark.slow
def test_corrupt_data_under_mpiexec_is_one_message_and_a_failed_exit(dataset_path, tmp_path):
    from tests.helpers import hpctrain_cmd, mpiexec, run

    bad = _corrupt("flipped byte", dataset_path, tmp_path / "bad.h5")
    p = run(mpiexec(2, *hpctrain_cmd("train", "default", f"--data.path={bad}",
                                     f"--train.out_dir={tmp_path}/out")))
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert p.returncode != 0 and len(errors) == 1, p.stderr
    assert "fail their CRC-32 check" in errors[0] and "re-create it" in errors[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
