"""Megatron-LM's indexed dataset (``prefix.bin`` + ``prefix.idx``, ``MMapIndexedDataset``),
read and checked without Megatron, for ``prepare --format megatron``.

The ``.idx``: the 9-byte magic ``MMIDIDX\\x00\\x00``, a little-endian uint64 version (1),
a uint8 dtype code, a uint64 sequence count S, a uint64 count D of document indices, then
int32 sizes[S] (tokens of each sequence), int64 pointers[S] (byte offsets into the
``.bin``) and int64 doc_idx[D] (the sequence where each document starts, from 0 to S).
The ``.bin`` holds the tokens, sequence after sequence. Every value is checked here, in
bounded chunks, before a token is read: a damaged or mismatched pair is one message.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpctrain.errors import DataError
from hpctrain.sizes import MAX_COUNT, whole

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py); 6 and 7 are
# floats there, which no token file holds.
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
FLOAT_CODES = (6, 7)
CHUNK = 1 << 22  # sequences checked at a time: bounded memory for any index
FIX = "give the prefix of a pair written by Megatron-LM's preprocess_data.py"


@dataclass(frozen=True)
class MegatronIndex:
    """A checked ``.bin``/``.idx`` pair: the tokens are ``n_tokens`` values of ``dtype``
    from byte 0 of ``bin_path``; ``doc_starts`` maps document j to its first token."""
    bin_path: Path
    idx_path: Path
    dtype: np.dtype
    n_tokens: int
    n_documents: int
    _pointers: np.ndarray
    _doc_idx: np.ndarray

    def doc_start(self, j: int) -> int:
        """The first token of document ``j`` (``n_documents`` gives ``n_tokens``)."""
        seq = int(self._doc_idx[j])
        return self.n_tokens if seq == len(self._pointers) else \
            int(self._pointers[seq]) // self.dtype.itemsize

    def nearest_document_start(self, target: int, low: int, high: int) -> int | None:
        """The document start nearest ``target`` within ``[low, high]`` (the earlier on a
        tie), or None: a binary search, as starts grow with the document."""
        target = min(max(target, low), high)
        lo, hi = 0, self.n_documents  # first j with doc_start(j) >= target
        while lo < hi:
            mid = (lo + hi) // 2
            if self.doc_start(mid) < target:
                lo = mid + 1
            else:
                hi = mid
        starts = [self.doc_start(j) for j in (lo - 1, lo) if 0 <= j <= self.n_documents]
        found = [s for s in starts if low <= s <= high]
        return min(found, key=lambda s: (abs(s - target), s)) if found else None


def megatron_prefix(path: str) -> str:
    """``data_text_document``, ``.bin`` or ``.idx``: the pair's common prefix."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def read_megatron_index(prefix: str) -> MegatronIndex:
    """Read and check ``prefix.idx`` against ``prefix.bin`` (module docstring)."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, bin_):
        if not p.is_file():
            raise DataError(f"{p} does not exist; --format megatron reads PREFIX.bin and "
                            "PREFIX.idx: give PREFIX (or either file)")
    size = idx.stat().st_size
    if size < HEADER.size:
        raise DataError(f"{idx} has {size} bytes, fewer than an index header; {FIX}")
    with open(idx, "rb") as f:
        magic, version, code, n_seq, n_doc = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise DataError(f"{idx} does not start with Megatron's magic MMIDIDX; is it a "
                        f"Megatron-LM .idx file? {FIX}")
    if version != 1:
        raise DataError(f"{idx} has index version {version}; this hpctrain reads version 1")
    if code in FLOAT_CODES or code not in DTYPES:
        what = "floats, not token ids" if code in FLOAT_CODES else "an unknown dtype"
        raise DataError(f"{idx}: dtype code {code} is {what}; {FIX}")
    dtype = np.dtype(DTYPES[code]).newbyteorder("<")
    n_seq = whole(n_seq, f"{idx}: the sequence count", 0, MAX_COUNT, error=DataError, fix=FIX)
    n_doc = whole(n_doc, f"{idx}: the document index count", 1, MAX_COUNT + 1,
                  error=DataError, fix=FIX)
    want = HEADER.size + 12 * n_seq + 8 * n_doc
    if size != want:
        extra = (" (one more byte per sequence: a multimodal index, which holds no text "
                 "tokens)" if size == want + n_seq else "")
        raise DataError(f"{idx} has {size:,} bytes; its header declares {want:,}{extra}: "
                        f"the file is truncated or damaged; {FIX}")
    sizes = np.memmap(idx, np.dtype("<i4"), "r", HEADER.size, (n_seq,)) if n_seq else \
        np.zeros(0, "<i4")
    pointers = np.memmap(idx, np.dtype("<i8"), "r", HEADER.size + 4 * n_seq, (n_seq,)) \
        if n_seq else np.zeros(0, "<i8")
    doc_idx = np.memmap(idx, np.dtype("<i8"), "r", HEADER.size + 12 * n_seq, (n_doc,))
    n_tokens = _check_sequences(idx, sizes, pointers, dtype.itemsize)
    _check_documents(idx, doc_idx, n_seq)
    if bin_.stat().st_size != n_tokens * dtype.itemsize:
        raise DataError(f"{bin_} has {bin_.stat().st_size:,} bytes; its index {idx.name} "
                        f"describes {n_tokens:,} tokens of {dtype.itemsize} byte(s): the "
                        f"pair does not match or the .bin is truncated; {FIX}")
    return MegatronIndex(bin_, idx, dtype, n_tokens, n_doc - 1, pointers, doc_idx)


def _check_sequences(idx: Path, sizes, pointers, itemsize: int) -> int:
    """Sizes are non-negative and each pointer is where the sequences before it end (the
    tokens are contiguous, as Megatron writes them); returns the token count."""
    end = 0  # bytes of the sequences checked so far
    for a in range(0, len(sizes), CHUNK):
        s = np.asarray(sizes[a:a + CHUNK], np.int64)
        if s.size and s.min() < 0:
            k = a + int(np.argmax(s < 0))
            raise DataError(f"{idx}: sequence {k:,} has the size {int(sizes[k])}; {FIX}")
        starts = end + np.concatenate(([0], np.cumsum(s[:-1]) * itemsize))
        bad = np.flatnonzero(np.asarray(pointers[a:a + CHUNK]) != starts)
        if bad.size:
            k = a + int(bad[0])
            raise DataError(f"{idx}: sequence {k:,} starts at byte {int(pointers[k]):,} of "
                            f"the .bin, not at {int(starts[bad[0]]):,} where the one before "
                            f"it ends: the index is damaged; {FIX}")
        end += int(s.sum()) * itemsize
    return end // itemsize


def _check_documents(idx: Path, doc_idx, n_seq: int) -> None:
    """The document indices run from sequence 0 to ``n_seq``, never backwards."""
    if int(doc_idx[0]) != 0 or int(doc_idx[-1]) != n_seq:
        raise DataError(f"{idx}: the document indices run from {int(doc_idx[0])} to "
                        f"{int(doc_idx[-1])}, not from 0 to the {n_seq:,} sequences; {FIX}")
    for a in range(0, len(doc_idx), CHUNK):
        d = np.asarray(doc_idx[max(0, a - 1):a + CHUNK])
        if np.any(np.diff(d) < 0):
            raise DataError(f"{idx}: the document indices go backwards; {FIX}")
