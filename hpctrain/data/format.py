"""The on-disk token file: one self-describing HDF5 container (or a manifest of several).

Format version 2: ``/train`` and ``/val`` are contiguous 1-D token arrays (uint16 when
the vocabulary fits, else uint32) at fixed byte offsets, with CRC-32 checksums per array
and per ``CHECKSUM_BLOCK_BYTES`` block, plus provenance (sources, per-source counts, the
split rule). The HDF5 part is written first (``create_token_file``), the token bytes
then at their offsets by one process (``write_token_file``) or every rank
(``prepare.py``), under a temporary name renamed into place. The spec is
``io/FORMAT.md``; the design: ``docs/design/data-path.md`` ("The token file").
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np

from hpctrain.sizes import GiB, MiB

MAGIC = "hpctrain-tokens"
MANIFEST_MAGIC = "hpctrain-tokens-manifest"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 1 lacks the per-array n_tokens/crc32 attributes and manifests; it is still read."""
SPLITS = ("train", "val")
CHECKSUM_BLOCK_BYTES = 64 * MiB
# Token arrays start on a 1 MiB boundary once they are large enough to matter: a window
# read then never touches one more Lustre stripe or page than it needs.
ALIGN_THRESHOLD, ALIGN_BYTES = MiB, MiB


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def block_crcs(data: np.ndarray | memoryview, block_bytes: int = CHECKSUM_BLOCK_BYTES) -> np.ndarray:
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    n_blocks = max(1, -(-len(view) // block_bytes))
    return np.array([zlib.crc32(view[i * block_bytes:(i + 1) * block_bytes])
                     for i in range(n_blocks)], dtype=np.uint32)


# ------------------------------------------------------------------ CRC-32 combination
# crc32(A + B) from crc32(A), crc32(B) and len(B), as zlib's crc32_combine (which Python's
# zlib does not expose): appending len(B) zero bytes is a linear map on the CRC register
# over GF(2), built by repeated squaring of the one-zero-bit operator. Ranks checksum their
# own pieces of an array and rank 0 joins them, so no rank ever reads the whole array.

def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=64)
def _zeros_operator(n_bytes: int) -> tuple[int, ...]:
    """The 32x32 GF(2) matrix (as 32 column words) that appends ``n_bytes`` zero bytes."""
    odd = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    op = [1 << n for n in range(32)]  # identity
    while True:
        even = _gf2_square(odd)  # first pass: one zero byte
        if n_bytes & 1:
            op = [_gf2_times(even, c) for c in op]
        n_bytes >>= 1
        if not n_bytes:
            break
        odd = _gf2_square(even)
        if n_bytes & 1:
            op = [_gf2_times(odd, c) for c in op]
        n_bytes >>= 1
        if not n_bytes:
            break
    return tuple(op)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of the concatenation A + B, given crc32(A), crc32(B) and len(B) in bytes."""
    if len2 <= 0:
        return crc1
    return _gf2_times(list(_zeros_operator(len2)), crc1) ^ crc2


def checksum_from_blocks(crcs: np.ndarray, nbytes: int, block_bytes: int) -> int:
    """CRC-32 of a whole array from the CRCs of its blocks."""
    total = 0
    for b, crc in enumerate(np.asarray(crcs, dtype=np.uint32).tolist()):
        length = min(block_bytes, nbytes - b * block_bytes)
        total = crc32_combine(total, crc, length) if b else crc
    return total


# ------------------------------------------------------------------------- writing

def create_token_file(path: str | os.PathLike, *, n_tokens: dict[str, int], dtype: np.dtype,
                      tokenizer_meta: dict, crcs: dict[str, np.ndarray],
                      sources: list[str], split: dict | None = None,
                      source_tokens: list[tuple[int, int]] | None = None) -> dict[str, int]:
    """Write the HDF5 part of a token file (all but the token bytes); return each split's
    byte offset, where its tokens go. ``split`` (the rule that chose the validation
    tokens) and ``source_tokens`` (each source's train and val token counts) are
    provenance that ``prepare`` records; files written otherwise leave them out.

    The token arrays are allocated at creation ("early") and never filled, so the
    metadata does not depend on who writes the tokens, or when; nothing in the file
    records a time, so the same inputs give the same bytes.
    """
    import h5py

    from hpctrain import __version__

    offsets = {}
    with h5py.File(path, "w", libver="latest", alignment_threshold=ALIGN_THRESHOLD,
                   alignment_interval=ALIGN_BYTES) as f:
        f.attrs["magic"] = MAGIC
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["tokenizer"] = json.dumps(tokenizer_meta)
        f.attrs["vocab_size"] = int(tokenizer_meta["vocab_size"])
        f.attrs["created_by"] = f"hpctrain {__version__}"
        file_type = h5py.h5t.STD_U16LE if np.dtype(dtype).itemsize == 2 else h5py.h5t.STD_U32LE
        for name in SPLITS:
            n = int(n_tokens[name])
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)  # no chunks, no filters: one byte offset
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            dcpl.set_obj_track_times(False)
            h5py.h5d.create(f.id, name.encode(), file_type, h5py.h5s.create_simple((n,)),
                            dcpl=dcpl)
            d = f[name]
            d.attrs["n_tokens"] = np.int64(n)
            d.attrs["crc32"] = np.uint32(checksum_from_blocks(
                crcs[name], n * np.dtype(dtype).itemsize, CHECKSUM_BLOCK_BYTES))
            f.create_dataset(f"crc32/{name}", data=np.asarray(crcs[name], np.uint32),
                             track_times=False)
            f[f"crc32/{name}"].attrs["block_bytes"] = CHECKSUM_BLOCK_BYTES
            offsets[name] = int(d.id.get_offset() or 0)
        f.create_dataset("sources", data=json.dumps(sources), track_times=False)
        if split is not None:
            f.attrs["split"] = json.dumps(split)
        if source_tokens is not None:
            f.create_dataset("source_tokens", data=np.asarray(source_tokens, np.int64)
                             .reshape(-1, 2), track_times=False)
    return offsets


def temp_name(path: Path) -> Path:
    """A fresh temporary name next to ``path`` (same directory: rename is atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def write_token_file(path: str | os.PathLike, splits: dict[str, np.ndarray],
                     tokenizer_meta: dict, sources: list[str] | None = None) -> Path:
    """Write ``splits`` (name -> token ids) atomically to ``path``, from one process."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab_size = int(tokenizer_meta["vocab_size"])
    dtype = token_dtype(vocab_size)
    arrays = {}
    for name in SPLITS:
        tokens = np.ascontiguousarray(splits[name], dtype=dtype)
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise ValueError(f"{name} has token {int(tokens.max())} >= vocab {vocab_size}")
        arrays[name] = tokens.astype(dtype.newbyteorder("<"), copy=False)
    tmp = temp_name(path)
    try:
        offsets = create_token_file(
            tmp, n_tokens={k: v.size for k, v in arrays.items()}, dtype=dtype,
            tokenizer_meta=tokenizer_meta, crcs={k: block_crcs(v) for k, v in arrays.items()},
            sources=sources or [])
        fd = os.open(tmp, os.O_WRONLY)
        try:
            for name, tokens in arrays.items():
                write_all(fd, memoryview(tokens).cast("B"), offsets[name])
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` until every byte is written (a single call may write fewer)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + GiB], offset + done)


# ------------------------------------------------------------------------ manifests

def write_manifest(path: str | os.PathLike, shards: list[dict], tokenizer_meta: dict,
                   dtype: np.dtype) -> Path:
    """Write a manifest listing ``shards`` (dicts with path, train_tokens, val_tokens,
    train_crc32, val_crc32); shard paths are stored relative to the manifest."""
    path = Path(path)
    doc = {"magic": MANIFEST_MAGIC, "format_version": FORMAT_VERSION,
           "tokenizer": tokenizer_meta, "vocab_size": int(tokenizer_meta["vocab_size"]),
           "dtype": np.dtype(dtype).name, "shards": shards}
    tmp = temp_name(path)
    try:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
