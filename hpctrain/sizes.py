"""One rule for sizes: a number read from a file or the command line is bounded and
finite before anything is allocated with it, and an HDF5 dataset is read only when the
file stores every byte its shape declares.

A typo, a damaged file or a crafted one (kilobytes of HDF5 declaring 20 GB never
written) would otherwise become a huge allocation on every rank, a hang or a silent
crash. Callers check each size where it enters, against the limits here (far above any
real run, far below what would exhaust a node), naming the number, the error and the fix.
Every size and its limit: docs/design/checkpoints.md ("One rule for sizes").
"""

from __future__ import annotations

import math
import os

MiB = 1 << 20
"""Bytes in a mebibyte: every size in MiB (bucket_mb, staging_mb, reports) converts with it."""
GiB = 1 << 30
"""Bytes in a gibibyte (device memory, the planner's memory column)."""

MAX_ELEMENTS = 1 << 40
"""Elements of any one tensor, bucket or model (4 TiB of fp32)."""
MAX_WORLD = 1 << 20
"""Ranks of a job: more than any machine has."""
MAX_LAYERS = 1 << 14
"""Transformer blocks (the largest published models have a few hundred)."""
MAX_WIDTH = 1 << 22
"""A model's widths and head counts (n_embd, n_head, ffn_hidden, ...)."""
MAX_EXPERTS = 1 << 16
"""Experts of one MoE block (the largest published models route over a few hundred)."""
MAX_CONTEXT = 1 << 24
"""Tokens of context (block_size)."""
MAX_VOCAB = 1 << 24
"""Token ids: 64 times the largest vocabulary in use; the token files hold uint32."""
MAX_BATCH_TOKENS = 1 << 32
"""Tokens of one training step, all ranks together (the largest runs take 2**24)."""
MAX_COUNT = 1 << 40
"""Any other count: steps, batches, sequences, tokens to sample."""
MAX_DOCUMENT_BYTES = 32 * MiB
"""UTF-8 bytes of one document of a records file (a JSON line's text field, a Parquet or
Arrow value) that ``prepare`` tokenizes: tokenizing it costs about ten times its size in
memory, and the longest documents of public corpora (whole books) are a few MiB."""
MAX_LINE_BYTES = 2 * MAX_DOCUMENT_BYTES
"""Bytes of one JSON line (its escapes, ``\\u00e9``, take more room than the text)."""
MAX_PAGE_BYTES = MAX_LINE_BYTES
"""Bytes a Parquet page decompresses to (a page holds whole values, so a document at the
limit fits; writers cut pages at about 1 MiB)."""
MAX_TEXT_FILE_BYTES = 256 * MiB
"""Bytes of a text file, which ``prepare`` reads and tokenizes whole as one document (a
single-file corpus such as enwik8, 95 MiB, fits)."""
MAX_WAIT_S = 7 * 86400.0
"""Seconds a deadline may allow a wait (``--comm.timeout``, ``--timeout``): a week; far
more overflows the thread waits that carry it (``threading.TIMEOUT_MAX``)."""


def whole(value, what: str, low: int, high: int, *, error: type[Exception] = ValueError,
          fix: str = "") -> int:
    """``value`` as an int in ``[low, high]``, else ``error`` naming ``what`` and ``fix``.
    A bool is refused (Python counts it as an int; no file format does)."""
    if type(value) is not int or not low <= value <= high:
        raise error(f"{what} is {show_value(value)}, not a whole number in [{low}, {high}]"
                    + (f"; {fix}" if fix else ""))
    return value


def finite(value, what: str, low: float, high: float = math.inf, *, low_open: bool = False,
           error: type[Exception] = ValueError, fix: str = "") -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``),
    else ``error``. NaN fails every comparison, so it is refused by name first."""
    ok = (type(value) in (int, float) and math.isfinite(value)
          and (value > low if low_open else value >= low) and value <= high)
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise error(f"{what} is {show_value(value)}, not a finite number in {span}"
                    + (f"; {fix}" if fix else ""))
    return float(value)


class StoredReads:
    """What may be read from one HDF5 file: every dataset whole on disk, and all of them
    together no more bytes than the file has (declarations may overlap: each within the
    file is not enough). ``check(dataset)`` before each read."""

    def __init__(self, path: str | os.PathLike, *, error: type[Exception], fix: str):
        self.path, self.error, self.fix = path, error, fix
        self.left = os.path.getsize(path)

    def check(self, d, name: str, *, zeros_of=None) -> None:
        """Refuse ``d`` (an h5py Dataset called ``name`` in messages) unless the file
        stores every byte it declares, it has no filter (whose output size nobody
        bounds) and it fits in what is left of the file. ``zeros_of``: a dataset of the
        same shape stored whole, which lets ``d`` be a never-written dataset of zeros
        (the Adam moments of imported weights): what it takes in memory is then bounded
        by the bytes stored for ``zeros_of``."""
        where = f"{self.path}: dataset {name}"
        if _filtered(d):
            self._refuse(f"{where} is filtered (compressed), which this format never writes")
        stored, declared = d.id.get_storage_size(), _declared_bytes(d)
        if stored == 0 and zeros_of is not None and _zeros_beside(d, zeros_of):
            return
        if stored < declared:
            self._refuse(f"{where} declares {declared:,} bytes ({d.dtype} of shape "
                         f"{d.shape}) but the file stores {stored:,} of them")
        if stored > self.left:
            self._refuse(f"{where} and the datasets read before it declare more bytes "
                         f"than the file holds ({os.path.getsize(self.path):,})")
        self.left -= stored

    def _refuse(self, message: str):
        raise self.error(f"{message}; {self.fix}")


def _declared_bytes(d) -> int:
    return (d.size or 0) * d.dtype.itemsize  # size is None for an empty dataspace


def _filtered(d) -> bool:
    return d.id.get_create_plist().get_nfilters() > 0


def _zeros_beside(d, other) -> bool:
    """``d`` reads as zeros (fill value 0) and ``other``, of its shape, is stored whole."""
    return (d.fillvalue == 0 and d.shape == other.shape and not _filtered(other)
            and other.id.get_storage_size() >= _declared_bytes(other))


def show_value(value) -> str:
    """A value for a message, short (a crafted one may be huge)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
