"""Read token windows from a prepared HDF5 file (``format.py``).

The HDF5 metadata is read once with h5py; the token arrays are contiguous, so windows
are read straight from their byte offset through a read-only memory map: a rank touches
only the pages of its own samples and memory does not grow with the file. The reader's
interface (``read(split, starts, length)``) is what an MPI-IO reader will also provide.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpctrain.data.format import FORMAT_VERSION, MAGIC, SPLITS, block_crcs
from hpctrain.data.tokenizers import tokenizer_from_meta
from hpctrain.errors import DataError

_PREPARE_HINT = "create it with `hpctrain prepare --input FILES... --output {path}`"


@dataclass(frozen=True)
class SplitInfo:
    name: str
    n_tokens: int
    dtype: np.dtype
    offset: int
    """Byte offset of the contiguous array in the file."""
    crc32: np.ndarray
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.n_tokens * self.dtype.itemsize


class TokenDataset:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.splits, meta = _read_metadata(self.path)
        self.tokenizer = tokenizer_from_meta(meta)
        self.vocab_size = self.tokenizer.vocab_size
        self._maps = {name: np.memmap(self.path, dtype=s.dtype, mode="r", offset=s.offset,
                                      shape=(s.n_tokens,))
                      for name, s in self.splits.items() if s.n_tokens}

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

    def read(self, split: str, starts: np.ndarray, length: int) -> np.ndarray:
        """Windows ``[s, s + length)`` for each start, as an int64 array (n, length)."""
        mm = self._maps[split]
        idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(length, dtype=np.int64)
        return mm[idx].astype(np.int64)

    def verify(self, index: int = 0, count: int = 1) -> list[str]:
        """Check the CRC of blocks ``index, index + count, ...``; return the bad ones.

        Ranks call it with their rank and the world size to verify a file in parallel.
        """
        bad = []
        for s in self.splits.values():
            mm = self._maps.get(s.name)
            raw = mm.view(np.uint8) if mm is not None else np.zeros(0, np.uint8)
            for b in range(index, len(s.crc32), count):
                chunk = raw[b * s.block_bytes:(b + 1) * s.block_bytes]
                if block_crcs(chunk, s.block_bytes)[0] != s.crc32[b]:
                    bad.append(f"{s.name} block {b}")
        return bad


def _read_metadata(path: Path) -> tuple[dict[str, SplitInfo], dict]:
    import h5py

    if not path.is_file():
        raise DataError(f"data file {path} does not exist; " + _PREPARE_HINT.format(path=path))
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path} is not a readable HDF5 file (truncated or corrupt?: {e}); "
                        + _PREPARE_HINT.format(path=path)) from None
    with f:
        if f.attrs.get("magic") != MAGIC:
            raise DataError(f"{path} is not an hpctrain token file (magic "
                            f"{f.attrs.get('magic')!r}); " + _PREPARE_HINT.format(path=path))
        version = int(f.attrs.get("format_version", -1))
        if version != FORMAT_VERSION:
            raise DataError(f"{path} has format version {version}, this hpctrain reads "
                            f"version {FORMAT_VERSION}; re-create it with this version's "
                            "`hpctrain prepare`")
        file_size = path.stat().st_size
        splits = {}
        for name in SPLITS:
            if name not in f or f"crc32/{name}" not in f:
                raise DataError(f"{path} has no '{name}' split; " + _PREPARE_HINT.format(path=path))
            d = f[name]
            offset = d.id.get_offset()
            n = int(d.shape[0])
            if n and offset is None:
                raise DataError(f"{path}:{name} is chunked or compressed; hpctrain needs "
                                "contiguous arrays. " + _PREPARE_HINT.format(path=path))
            info = SplitInfo(name, n, np.dtype(d.dtype), int(offset or 0),
                             f[f"crc32/{name}"][()], int(f[f"crc32/{name}"].attrs["block_bytes"]))
            if info.offset + info.nbytes > file_size:
                raise DataError(f"{path} is truncated: the {name} split needs bytes up to "
                                f"{info.offset + info.nbytes}, the file has {file_size}. "
                                + _PREPARE_HINT.format(path=path))
            splits[name] = info
        meta = json.loads(f.attrs["tokenizer"])
    return splits, meta
