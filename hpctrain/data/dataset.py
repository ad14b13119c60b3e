"""What a prepared dataset holds, how it is checked, and the memory-map reader.

``read_info`` opens a token file or a manifest (``format.py``) with h5py, checks it, and
returns a ``DatasetInfo``: for each split, the contiguous arrays ("parts", one per file)
whose concatenation is the split, with their byte offsets. Readers only need that: the
token bytes are read straight from the offsets, without HDF5.

A reader's interface is ``read(split, starts, length) -> (len(starts), length)`` int64
windows. ``TokenDataset`` here reads through a read-only memory map (one process, tests,
the single-process reference); ``mpiio.py`` reads with MPI-IO. No MPI in this module.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hpctrain.data.format import (FORMAT_VERSION, MAGIC, MANIFEST_MAGIC, READABLE_VERSIONS,
                                  SPLITS, checksum_from_blocks)
from hpctrain.data.tokenizers import tokenizer_from_meta
from hpctrain.errors import DataError
from hpctrain.sizes import MAX_VOCAB, MiB, StoredReads, whole

_PREPARE_HINT = "create it with `hpctrain prepare --input FILES... --output {path}`"
_VERIFY_READ_BYTES = 8 * MiB  # verification reads (and holds) this much at a time


@dataclass(frozen=True)
class SplitPart:
    """One contiguous token array in one file: tokens ``[start, start + n_tokens)`` of a split."""
    file: int
    """Index into ``DatasetInfo.files``."""
    offset: int
    """Byte offset of the array in its file."""
    start: int
    n_tokens: int
    crc32: np.ndarray
    """CRC-32 of each ``block_bytes`` block of the array."""
    block_bytes: int


@dataclass(frozen=True)
class SplitInfo:
    name: str
    n_tokens: int
    dtype: np.dtype
    parts: tuple[SplitPart, ...]

    @property
    def nbytes(self) -> int:
        return self.n_tokens * self.dtype.itemsize

    @property
    def offset(self) -> int:
        """Byte offset of the (first) array in its file."""
        return self.parts[0].offset


@dataclass(frozen=True)
class DatasetInfo:
    path: Path
    """The token file, or the manifest."""
    files: tuple[Path, ...]
    """The files holding token arrays (one, or a manifest's shards)."""
    splits: dict[str, SplitInfo]
    tokenizer_meta: dict
    vocab_size: int

    def with_files(self, files) -> "DatasetInfo":
        """The same dataset read from copies of its files (the node-local copy)."""
        return replace(self, files=tuple(Path(f) for f in files))


# ------------------------------------------------------------------- reading metadata

def read_info(path: str | os.PathLike) -> DatasetInfo:
    """Open and check a token file or manifest; every problem is one ``DataError``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; " + _PREPARE_HINT.format(path=path))
    if path.suffix == ".json":
        return _read_manifest(path)
    meta, arrays = _read_token_file(path)
    dtype = arrays["train"]["dtype"]
    splits = {name: SplitInfo(name, a["n_tokens"], dtype, (
        SplitPart(0, a["offset"], 0, a["n_tokens"], a["crc32"], a["block_bytes"]),))
        for name, a in arrays.items()}
    return DatasetInfo(path, (path,), splits, meta, int(meta["vocab_size"]))


def _read_token_file(path: Path) -> tuple[dict, dict[str, dict]]:
    import h5py

    hint = _PREPARE_HINT.format(path=path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path} is not a readable HDF5 file (truncated or corrupt?: {e}); "
                        + hint) from None
    with f:
        if f.attrs.get("magic") != MAGIC:
            raise DataError(f"{path} is not an hpctrain token file (magic "
                            f"{f.attrs.get('magic')!r}); " + hint)
        version = int(f.attrs.get("format_version", -1))
        if version not in READABLE_VERSIONS:
            newer = " (made by a newer hpctrain: upgrade, or" if version > FORMAT_VERSION else " ("
            raise DataError(f"{path} has format version {version}, this hpctrain reads "
                            f"version(s) {', '.join(map(str, READABLE_VERSIONS))}{newer} "
                            "re-create it with this version's `hpctrain prepare`)")
        try:
            meta = json.loads(f.attrs["tokenizer"])
            whole(meta["vocab_size"], f"{path}: the tokenizer's vocab_size", 1, MAX_VOCAB)
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{path} has no readable tokenizer description ({e}); "
                            + hint) from None
        file_size = path.stat().st_size
        reads = StoredReads(path, error=DataError, fix="the file is corrupt. " + hint)
        arrays = {}
        for name in SPLITS:
            if name not in f or f"crc32/{name}" not in f:
                raise DataError(f"{path} has no '{name}' split; " + hint)
            d = f[name]
            offset = d.id.get_offset()
            n = int(d.shape[0])
            if n and offset is None:
                raise DataError(f"{path}:{name} is chunked or compressed; hpctrain needs "
                                "contiguous arrays. " + hint)
            dtype = np.dtype(d.dtype)
            if dtype not in (np.dtype("<u2"), np.dtype("<u4")):
                raise DataError(f"{path}:{name} holds {dtype}, not little-endian uint16 or "
                                "uint32 tokens; " + hint)
            nbytes = n * dtype.itemsize
            if offset is not None and offset + nbytes > file_size:
                raise DataError(f"{path} is truncated: the {name} split needs bytes up to "
                                f"{offset + nbytes}, the file has {file_size}. " + hint)
            crcs, block_bytes = _checksum_table(f, path, name, nbytes, hint, reads)
            if version >= 2:
                if int(d.attrs.get("n_tokens", -1)) != n:
                    raise DataError(f"{path}: {name} should hold {d.attrs.get('n_tokens')} "
                                    f"tokens but holds {n}; the file is corrupt. " + hint)
                # The array's checksum must agree with its block checksums: a damaged
                # checksum table is caught here, damaged tokens by ``verify``.
                if checksum_from_blocks(crcs, nbytes, block_bytes) != int(d.attrs["crc32"]):
                    raise DataError(f"{path}: the checksums of {name} disagree with each "
                                    "other; the file is corrupt. " + hint)
            arrays[name] = {"offset": int(offset or 0), "n_tokens": n, "dtype": dtype,
                            "crc32": crcs, "block_bytes": block_bytes,
                            "checksum": int(d.attrs["crc32"]) if version >= 2 else None}
        if arrays["train"]["dtype"] != arrays["val"]["dtype"]:
            raise DataError(f"{path}: train and val hold different token types; " + hint)
    return meta, arrays


def _checksum_table(f, path: Path, name: str, nbytes: int, hint: str, reads: StoredReads):
    """The block CRCs of split ``name`` and their block size. The table's declared shape
    is checked against the array's size, and its stored bytes against the declared ones
    (``reads``), before it is read, so a damaged or crafted shape is refused instead of
    becoming an allocation."""
    table = f[f"crc32/{name}"]
    block_bytes = table.attrs.get("block_bytes")
    if not isinstance(block_bytes, (int, np.integer)) or block_bytes <= 0:
        raise DataError(f"{path}: the checksum table of {name} has block size "
                        f"{block_bytes!r}; the file is corrupt. " + hint)
    blocks = max(1, -(-nbytes // int(block_bytes)))
    if table.shape != (blocks,) or table.dtype.kind not in "ui":
        raise DataError(f"{path}: the checksum table of {name} is {table.dtype} of shape "
                        f"{table.shape}, the array needs {blocks} integer entries; the file "
                        "is corrupt. " + hint)
    reads.check(table, f"crc32/{name}")
    return table[()], int(block_bytes)


def _read_manifest(path: Path) -> DatasetInfo:
    hint = ("re-create it with `hpctrain prepare --combine SHARDS... --output "
            f"{path}`")
    try:
        doc = json.loads(path.read_text())
        shards = doc["shards"]
        meta = doc["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path} is not a readable dataset manifest ({e}); {hint}") from None
    if doc.get("magic") != MANIFEST_MAGIC:
        raise DataError(f"{path} is not an hpctrain dataset manifest (magic "
                        f"{doc.get('magic')!r}); token files end in .h5, manifests in .json")
    if doc.get("format_version") not in READABLE_VERSIONS or not shards:
        raise DataError(f"{path} has format version {doc.get('format_version')!r} or no "
                        f"shards; {hint}")
    files, parts = [], {name: [] for name in SPLITS}
    starts = dict.fromkeys(SPLITS, 0)
    dtype = None
    for i, shard in enumerate(shards):
        shard_path = path.parent / shard["path"]
        if not shard_path.is_file():
            raise DataError(f"{path} lists shard {shard['path']}, which does not exist "
                            f"({shard_path}); copy it there or {hint}")
        shard_meta, arrays = _read_token_file(shard_path)
        if shard_meta != meta:
            raise DataError(f"shard {shard_path} was prepared with another tokenizer than "
                            f"{path} says ({shard_meta.get('name')}, vocabulary "
                            f"{shard_meta.get('vocab_size')}); {hint}")
        for name in SPLITS:
            a = arrays[name]
            want_n, want_crc = shard.get(f"{name}_tokens"), shard.get(f"{name}_crc32")
            if want_n != a["n_tokens"] or (want_crc is not None and a["checksum"] is not None
                                           and want_crc != a["checksum"]):
                raise DataError(f"shard {shard_path} does not match {path}: {name} has "
                                f"{a['n_tokens']} tokens (checksum {a['checksum']}), the "
                                f"manifest says {want_n} ({want_crc}); the shard was "
                                f"replaced or damaged; {hint}")
            if dtype is not None and a["dtype"] != dtype:
                raise DataError(f"shard {shard_path} holds {a['dtype']} tokens, the others "
                                f"{dtype}; {hint}")
            dtype = a["dtype"]
            parts[name].append(SplitPart(i, a["offset"], starts[name], a["n_tokens"],
                                         a["crc32"], a["block_bytes"]))
            starts[name] += a["n_tokens"]
        files.append(shard_path)
    splits = {name: SplitInfo(name, starts[name], dtype, tuple(parts[name])) for name in SPLITS}
    return DatasetInfo(path, tuple(files), splits, meta, int(meta["vocab_size"]))


# ------------------------------------------------------------------------- readers

def check_windows(split: SplitInfo, starts: np.ndarray, length: int) -> None:
    if starts.size and (starts.min() < 0 or starts.max() + length > split.n_tokens):
        raise ValueError(f"windows of {length} tokens starting at {starts.min()}..."
                         f"{starts.max()} do not fit the {split.n_tokens}-token {split.name} split")


def window_pieces(split: SplitInfo, starts: np.ndarray, length: int):
    """Where each window ``[s, s + length)`` lies: yields ``(row, col, part, first, count)``,
    meaning tokens ``[first, first + count)`` of ``part`` go to ``out[row, col:col + count]``.
    A window that crosses from one shard into the next yields one piece per shard."""
    starts = np.asarray(starts, dtype=np.int64)
    check_windows(split, starts, length)
    part_starts = np.array([p.start for p in split.parts], dtype=np.int64)
    first_part = np.searchsorted(part_starts, starts, side="right") - 1
    for row, (s, j) in enumerate(zip(starts.tolist(), first_part.tolist())):
        col = 0
        while col < length:
            part = split.parts[j]
            first = s + col - part.start
            count = min(length - col, part.n_tokens - first)
            if count > 0:
                yield row, col, part, first, count
                col += count
            j += 1


class BaseReader:
    """Metadata, checks and verification shared by every reader."""

    def __init__(self, info: DatasetInfo):
        self.info = info
        self.path = info.path
        self.splits = info.splits
        self.tokenizer = tokenizer_from_meta(info.tokenizer_meta)
        self.vocab_size = info.vocab_size

    def check_fits(self, block_size: int, model_vocab: int) -> None:
        """Raise a ``DataError`` naming the fix if the model cannot train on this data."""
        if model_vocab and self.vocab_size > model_vocab:
            raise DataError(f"{self.path} has a vocabulary of {self.vocab_size} tokens, larger "
                            f"than --model.vocab_size={model_vocab}; set "
                            f"--model.vocab_size={self.vocab_size} (or 0 to take it from the data)")
        for s in self.splits.values():
            if s.n_tokens < block_size + 1:
                raise DataError(f"the {s.name} split of {self.path} has {s.n_tokens} tokens, "
                                f"fewer than one window of --model.block_size={block_size} + 1; "
                                "lower the block size or prepare more text")

    def read(self, split: str, starts: np.ndarray, length: int, *,
             uniform: bool = False) -> np.ndarray:
        """Windows ``[s, s + length)`` for each start, as an int64 array (n, length).

        ``uniform`` promises that every rank passes as many starts as this one (readers
        that read collectively then skip agreeing on the number of reads)."""
        raise NotImplementedError

    def verify(self, index: int = 0, count: int = 1) -> list[str]:
        """Check the CRC of blocks ``index, index + count, ...``; return the bad ones.

        Ranks call it with their rank and the world size to verify a file in parallel.
        Blocks are read with ``pread`` a few MiB at a time: memory stays flat.
        """
        jobs = [(s, p, b) for s in self.splits.values() for p in s.parts
                for b in range(len(p.crc32))]
        buf = bytearray(_VERIFY_READ_BYTES)
        bad, fds = [], {}
        try:
            for split, part, b in jobs[index::count]:
                if part.file not in fds:
                    fds[part.file] = os.open(self.info.files[part.file], os.O_RDONLY)
                lo = b * part.block_bytes
                hi = min(lo + part.block_bytes, part.n_tokens * split.dtype.itemsize)
                if _crc_of_range(fds[part.file], part.offset + lo, part.offset + hi,
                                 buf) != int(part.crc32[b]):
                    where = "" if len(self.info.files) == 1 else \
                        f" of {self.info.files[part.file].name}"
                    bad.append(f"{split.name} block {b}{where}")
        finally:
            for fd in fds.values():
                os.close(fd)
        return bad

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _crc_of_range(fd: int, lo: int, hi: int, buf: bytearray) -> int | None:
    """CRC-32 of bytes ``[lo, hi)`` of ``fd``; None if the file ends before ``hi``."""
    crc, view = 0, memoryview(buf)
    while lo < hi:
        n = os.preadv(fd, [view[:min(len(buf), hi - lo)]], lo)
        if n == 0:
            return None
        crc = zlib.crc32(view[:n], crc)
        lo += n
    return crc


class TokenDataset(BaseReader):
    """Reads windows through read-only memory maps: a process touches only the pages of
    its own samples. The single-process reader (tests, the reference, ``--data.reader=mmap``)."""

    def __init__(self, path: str | os.PathLike | DatasetInfo):
        super().__init__(path if isinstance(path, DatasetInfo) else read_info(path))
        self._maps: dict[int, np.memmap] = {}

    def _map(self, split: SplitInfo, part: SplitPart) -> np.memmap:
        key = id(part)
        if key not in self._maps:
            self._maps[key] = np.memmap(self.info.files[part.file], dtype=split.dtype,
                                        mode="r", offset=part.offset, shape=(part.n_tokens,))
        return self._maps[key]

    def read(self, split: str, starts: np.ndarray, length: int, *,
             uniform: bool = False) -> np.ndarray:
        s = self.splits[split]
        starts = np.asarray(starts, dtype=np.int64)
        if len(s.parts) == 1:
            check_windows(s, starts, length)
            idx = starts[:, None] + np.arange(length, dtype=np.int64)
            return self._map(s, s.parts[0])[idx].astype(np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, col, part, first, count in window_pieces(s, starts, length):
            out[row, col:col + count] = self._map(s, part)[first:first + count]
        return out

    def close(self) -> None:
        self._maps.clear()
