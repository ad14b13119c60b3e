"""The on-disk token file: one self-describing HDF5 container.

Layout (format version 1; ``io/FORMAT.md`` is the user-facing spec):

    /                 attrs: magic, format_version, tokenizer (JSON), vocab_size, created_by
    /train, /val      1-D token arrays, uint16 when the vocabulary fits, else uint32;
                      contiguous (never chunked or compressed), so each has a fixed byte
                      offset in the file and can be read without HDF5 by memmap or MPI-IO
    /crc32/train, /crc32/val
                      CRC-32 of each CHECKSUM_BLOCK_BYTES block of the array's bytes, so
                      ranks can verify a large file in parallel, block by block
    /sources          the input file names, one JSON list (provenance)

Files are written to a temporary name in the same directory and renamed into place, so
an interrupted write never leaves a half-written file under the final name.
"""

from __future__ import annotations

import json
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np

MAGIC = "hpctrain-tokens"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
CHECKSUM_BLOCK_BYTES = 64 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def block_crcs(data: np.ndarray | memoryview, block_bytes: int = CHECKSUM_BLOCK_BYTES) -> np.ndarray:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    n_blocks = max(1, -(-len(view) // block_bytes))
    return np.array([zlib.crc32(view[i * block_bytes:(i + 1) * block_bytes])
                     for i in range(n_blocks)], dtype=np.uint32)


def write_token_file(path: str | os.PathLike, splits: dict[str, np.ndarray],
                     tokenizer_meta: dict, sources: list[str] | None = None) -> Path:
    """Write ``splits`` (name -> token ids) atomically to ``path``."""
    import h5py

    from hpctrain import __version__

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab_size = int(tokenizer_meta["vocab_size"])
    dtype = token_dtype(vocab_size)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with h5py.File(tmp, "w", libver="latest") as f:
            f.attrs["magic"] = MAGIC
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["tokenizer"] = json.dumps(tokenizer_meta)
            f.attrs["vocab_size"] = vocab_size
            f.attrs["created_by"] = f"hpctrain {__version__}"
            for name in SPLITS:
                tokens = np.ascontiguousarray(splits[name], dtype=dtype)
                if tokens.size and int(tokens.max()) >= vocab_size:
                    raise ValueError(f"{name} has token {int(tokens.max())} >= vocab {vocab_size}")
                # No chunks, no filters: the array lives at one byte offset in the file.
                f.create_dataset(name, data=tokens)
                f.create_dataset(f"crc32/{name}", data=block_crcs(tokens))
                f[f"crc32/{name}"].attrs["block_bytes"] = CHECKSUM_BLOCK_BYTES
            f.create_dataset("sources", data=json.dumps(sources or []))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
