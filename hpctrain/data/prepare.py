"""``hpctrain prepare``: text and records files -> one HDF5 token file (see ``format.py``),
on one process or on every rank of an MPI job, with the same bytes either way.

Rank 0 lists the inputs; every rank plans the same units of work (``sources.py``),
tokenizes its contiguous share of them (``prepare_tokenize.py``), and the ranks agree on
the validation split from the files' token counts (``split.py``). Rank 0 writes the HDF5
metadata and checksums under a temporary name, every rank writes its tokens at their
offsets with checked collective MPI-IO (``mpiio_write.py``), the checksums are read back,
and the file is renamed into place. Every collective has a deadline (``--timeout``).
The steps and their reasons: ``docs/design/data-path.md`` ("Parallel preparation").
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpctrain.atomic import (WRITE_ERRORS, WRITE_FIX, h5_bytes, reserve_space,
                             write_failed)
from hpctrain.data.dataset import BaseReader, read_info
from hpctrain.data.format import (CHECKSUM_BLOCK_BYTES, SPLITS, checksum_from_blocks,
                                  create_token_file, crc32_combine, write_manifest)
from hpctrain.data.prepare_group import Group, Solo, attempt
from hpctrain.data.prepare_tokenize import tokenize
from hpctrain.data.spill import TokenSpill
from hpctrain.data.document_reader import parquet_row_group_bytes, require_extra
from hpctrain.data.sources import PARQUET, Plan, expand_inputs, file_format, plan_units
from hpctrain.data.split import SPLIT_RULE, SPLIT_SEED, val_tokens_per_file
from hpctrain.data.tokenizers import check_tokenizer_name
from hpctrain.errors import DataError
from hpctrain.file_modes import chmod_as_created
from hpctrain.output_paths import check_output_file
from hpctrain.sizes import MAX_WAIT_S, MiB, finite

__all__ = ["prepare", "combine", "expand_inputs", "assign_files", "check_output"]
BAD_RECORD_CHOICES = ("fail", "skip")

WRITE_CHUNK_BYTES = 256 * MiB  # a rank writes its tokens in collective rounds of this size


def assign_files(sizes: list[int], n_ranks: int) -> list[tuple[int, int]]:
    """Rank r takes files ``[lo, hi)``: contiguous runs of about total/n bytes each (a file
    goes to the rank whose share holds its middle byte)."""
    total, pos, owners = sum(sizes), 0, []
    for size in sizes:
        owners.append(min(n_ranks - 1, (2 * pos + size) * n_ranks // (2 * total)) if total else 0)
        pos += size
    return [(sum(o < r for o in owners), sum(o <= r for o in owners)) for r in range(n_ranks)]


def crc_pieces(data: memoryview, start: int, block_bytes: int = CHECKSUM_BLOCK_BYTES) -> list:
    """``data`` holds bytes ``[start, start + len)`` of an array: (block, CRC, length) of
    each piece of it that falls in one checksum block."""
    pieces, pos = [], 0
    while pos < len(data):
        block = (start + pos) // block_bytes
        end = min(len(data), (block + 1) * block_bytes - start)
        pieces.append((block, zlib.crc32(data[pos:end]), end - pos))
        pos = end
    return pieces


def join_crc_pieces(pieces: list, nbytes: int, block_bytes: int = CHECKSUM_BLOCK_BYTES) -> np.ndarray:
    """The CRC of every block from the pieces of all ranks, in array order."""
    crcs = [0] * max(1, -(-nbytes // block_bytes))
    seen = [False] * len(crcs)
    for block, crc, length in pieces:
        crcs[block] = crc32_combine(crcs[block], crc, length) if seen[block] else crc
        seen[block] = True
    return np.array(crcs, dtype=np.uint32)


DEFAULT_TIMEOUT_S = 300.0  # as training's --comm.timeout



def check_output(output: Path, overwrite: bool, example: str = "data.h5",
                 inputs=()) -> None:
    """Refuse an output path that is a directory, device, FIFO or link, an existing file
    without ``overwrite`` (a dataset takes long to make, and runs or manifests may point
    at it), an input or a path inside an input folder. Checked before anything is
    written, so a refusal leaves the disk as it was."""
    check_output_file(output, overwrite=overwrite, example=example, inputs=inputs,
                      error=DataError)


def check_inputs_once(files: list[str]) -> None:
    """The same file given twice (two globs, a folder and a file in it) would be read
    twice: refused by name."""
    seen: dict[str, str] = {}
    for name in files:
        key = os.path.realpath(name)
        if key in seen:
            raise DataError(f"{name} is given twice (also as {seen[key]}); name each input "
                            "once")
        seen[key] = name


# --------------------------------------------------------------------------- prepare

def prepare(inputs: list[str] | list[Path], output: str | Path, *, tokenizer: str = "char",
            val_fraction: float = 0.1, show_progress: bool = True, comm=None,
            romio_hints: dict | None = None, overwrite: bool = False,
            timeout: float = DEFAULT_TIMEOUT_S, text_field: str = "text",
            on_bad_record: str = "fail") -> dict:
    """Tokenize ``inputs`` into ``output``; return a summary dict.

    With ``comm`` (an MPI communicator) every rank of it must call this with the same
    arguments; the work is shared and the file is the one a single process writes. Every
    collective waits at most ``timeout`` seconds. An existing ``output`` is replaced only
    with ``overwrite``. ``text_field`` names the document of a records file;
    ``on_bad_record`` says whether a bad record fails the command before anything is
    written ("fail") or is left out ("skip"). The numbered steps are those of the module
    docstring.
    """
    finite(timeout, "--timeout", 0.0, MAX_WAIT_S, low_open=True, error=DataError)
    if on_bad_record not in BAD_RECORD_CHOICES:
        raise DataError(f"--on-bad-record is skip or fail, not {on_bad_record!r}")
    group = Solo() if comm is None else Group(comm, timeout)
    output, hints = Path(output), romio_hints or {}
    check_tokenizer_name(tokenizer)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be between 0 and 1, not {val_fraction}")
    plan = _plan(group, inputs, output, overwrite, text_field)  # 1-2
    tok, dtype, spill, bad = tokenize(group, plan, tokenizer, text_field,  # 3
                                      show_progress and group.rank == 0, output)
    try:
        if bad.count and on_bad_record == "fail":  # every rank has the same count
            raise DataError(f"{bad.message()}; fix them, or leave them out with "
                            "--on-bad-record=skip")
        split = _split(group, spill, plan, val_fraction, dtype)  # 4
        gathered = group.allgather(split.pieces, "checksums")  # 5 (rank 0 joins them), 6
        write_token_file(group, output, hints, split, lambda tmp: _create_header(
            tmp, split, gathered, tok.meta(), plan.names, val_fraction))
    finally:
        spill.remove()
    group.barrier("barrier after publishing the file")  # and removing every spill
    n_train, n_val = split.n_tokens["train"], split.n_tokens["val"]
    return {"output": str(output), "files": len(plan.names), "tokens": n_train + n_val,
            "train_tokens": n_train, "val_tokens": n_val, "vocab_size": tok.vocab_size,
            "tokenizer": tok.name, "ranks": group.size, "bad_records": bad.count,
            "bad_record_examples": bad.first}


def _plan(group, inputs, output: Path, overwrite: bool, text_field: str) -> Plan:
    """Steps 1-2: every input file and its format (listed once, on rank 0, after the
    output check), the units of work, and this rank's run of them."""
    def listing():
        if group.rank != 0:
            return None
        files = [str(f) for f in expand_inputs([str(p) for p in inputs])]
        check_output(output, overwrite, inputs=files)  # an earlier output among them
        check_inputs_once(files)
        formats = [file_format(f) for f in files]
        for name, fmt in zip(files, formats):
            require_extra(fmt, name)
        row_groups = [parquet_row_group_bytes(f, text_field) if fmt == PARQUET else []
                      for f, fmt in zip(files, formats)]
        return files, formats, [os.stat(f).st_size for f in files], row_groups
    names, formats, sizes, row_groups = group.bcast(attempt(group, listing, "file list"),
                                                    "file list")
    units = plan_units(sizes, formats, row_groups, group.size)
    lo, hi = assign_files([u[3] for u in units], group.size)[group.rank]
    return Plan(names, formats, units, lo, hi)


@dataclass
class _Split:
    """Step 4's answer: the split (the same on every rank) and this rank's part of it."""
    dtype: np.dtype
    n_tokens: dict[str, int]
    """Tokens of each split in the whole file."""
    source_tokens: list[tuple[int, int]]
    """(train, val) tokens of every input file."""
    local: dict[str, tuple[int, list[memoryview]]]
    """Split -> (index of this rank's first token in it, this rank's tokens as bytes: views
    of its spill, which follow each other in the split)."""
    pieces: dict[str, list]
    """Split -> this rank's pieces of the checksum blocks (``crc_pieces``)."""


def _split(group, spill: TokenSpill, plan: Plan, val_fraction: float,
           dtype: np.dtype) -> _Split:
    """Step 4: the split, from every unit's token count, and this rank's piece of each
    split with its checksums. A file's tokens are its units' tokens in order, and its
    train part their first tokens: a unit's train part is what of it lies there."""
    counts = [c for run in group.allgather(spill.counts, "token counts") for c in run]
    per_file, offset_in_file = [0] * len(plan.names), []
    for (f, *_), c in zip(plan.units, counts):
        offset_in_file.append(per_file[f])
        per_file[f] += c
    n = sum(counts)
    n_train = int(n * (1.0 - val_fraction))
    if n_train < 2 or n - n_train < 2:
        raise DataError(f"the input has only {n} tokens: too few for a train and a validation "
                        "split; give more text or change --val-fraction")
    val = val_tokens_per_file(per_file, n - n_train)
    train = [min(c, max(0, per_file[f] - val[f] - off))  # each unit's train part
             for (f, *_), c, off in zip(plan.units, counts, offset_in_file)]
    # Files keep their input order inside a split, and units inside a file: this rank's
    # parts of its run of units are one piece of each split, after those of the units
    # before the run.
    lo = plan.lo
    ranges = {"train": [], "val": []}
    for start, count, t in zip(spill.unit_starts(), spill.counts, train[lo:]):
        _add_range(ranges["train"], start, start + t)
        _add_range(ranges["val"], start + t, start + count)
    before = {"train": sum(train[:lo]), "val": sum(counts[:lo]) - sum(train[:lo])}
    local, pieces = {}, {}
    for name in SPLITS:
        views = [memoryview(spill.tokens(a, b)).cast("B") for a, b in ranges[name]]
        local[name], pieces[name] = (before[name], views), []
        pos = before[name] * dtype.itemsize
        for view in views:
            pieces[name] += crc_pieces(view, pos)
            pos += len(view)
    return _Split(dtype, {"train": n_train, "val": n - n_train},
                  [(c - v, v) for c, v in zip(per_file, val)], local, pieces)


def _add_range(ranges: list[list[int]], start: int, stop: int) -> None:
    """Append tokens ``[start, stop)`` of the spill, joined to the last range where they
    follow it (a file's train parts, and its validation parts, are adjacent there)."""
    if stop <= start:
        return
    if ranges and ranges[-1][1] == start:
        ranges[-1][1] = stop
    else:
        ranges.append([start, stop])


def _create_header(tmp: Path, split: _Split, gathered: list, tokenizer_meta: dict,
                   names: list[str], val_fraction: float) -> dict:
    """Step 5, on rank 0: join every rank's checksum pieces and write the HDF5 part (the
    metadata, the checksums, the space for the tokens); returns the arrays' offsets."""
    crcs = {name: join_crc_pieces([p for g in gathered for p in g[name]],
                                  count * split.dtype.itemsize)
            for name, count in split.n_tokens.items()}
    rule = {"rule": SPLIT_RULE, "seed": SPLIT_SEED, "val_fraction": val_fraction}
    return create_token_file(tmp, n_tokens=split.n_tokens, dtype=split.dtype,
                             tokenizer_meta=tokenizer_meta, crcs=crcs, sources=names,
                             split=rule, source_tokens=split.source_tokens)


def write_token_file(group, output: Path, hints: dict, split: _Split, create_header,
                      rounds=None) -> None:
    """Steps 5-6 under a temporary name: rank 0 writes the header (``create_header(tmp)``
    returns the arrays' byte offsets), then every rank its tokens; the file takes its
    name only once complete, and a failure removes it. ``rounds(group, split, offsets)``
    gives the writes (``_write_rounds`` by default; ``token_import.py`` its own)."""
    tmp = None
    try:
        tmp = group.create(output, hints)

        def header():
            if group.rank != 0:
                return None
            try:  # the room for every token first: HDF5 crashes on a full disk
                reserve_space(output.parent, h5_bytes([n * split.dtype.itemsize
                                                       for n in split.n_tokens.values()]))
                return create_header(tmp)
            except WRITE_ERRORS as e:  # h5py: OSError or RuntimeError
                raise write_failed(output, e) from None
        offsets = group.bcast(attempt(group, header, "HDF5 metadata"), "array offsets")
        per_round = (rounds or _write_rounds)(group, split, offsets)
        attempt(group, lambda: group.write(tmp, output, hints, per_round),
                "writing the tokens")
        attempt(group, lambda: _check_written(tmp, output, group.rank, group.size),
                "reading the tokens back")
        group.barrier("barrier before publishing the file")
        if group.rank == 0:
            _publish(tmp, output)
        tmp = None
    finally:
        if tmp is not None and group.rank == 0:
            Path(tmp).unlink(missing_ok=True)


def _check_written(tmp: Path, output: Path, rank: int, size: int) -> None:
    """Step 6's end: read the file back, each rank its share of the checksum blocks, as
    ``hpctrain train`` verifies a dataset. A write that came up short without an error
    (``mpiio_write.py``: into the holes of the preallocated arrays) shows here as a
    block whose CRC-32 is not the one computed from the tokens."""
    bad = BaseReader(read_info(tmp)).verify(rank, size)
    if bad:
        raise DataError(f"writing {output} failed: {bad[0]} reads back other bytes than were "
                        f"written (a short write); {WRITE_FIX}")


def _write_rounds(group, split: _Split, offsets: dict) -> list[list[tuple[int, memoryview]]]:
    """Step 6's writes, (byte offset, bytes) of at most WRITE_CHUNK_BYTES each, one per
    collective round; every rank makes the same number of rounds (empty ones at the end)."""
    writes = []
    for name in SPLITS:
        first, views = split.local[name]
        base = offsets[name] + first * split.dtype.itemsize
        for data in views:
            writes += [(base + k, data[k:k + WRITE_CHUNK_BYTES])
                       for k in range(0, len(data), WRITE_CHUNK_BYTES)]
            base += len(data)
    rounds = max(group.allgather(len(writes), "write rounds"))
    return [[w] for w in writes] + [[] for _ in range(rounds - len(writes))]


def _publish(tmp: Path, output: Path) -> None:
    """Give the finished file the mode a plain ``open()`` would (the temporary name was
    created 0600, which would shut teammates out of a dataset on a shared project file
    system, and only when it was written by one process), then rename it into place."""
    chmod_as_created(tmp)
    os.replace(tmp, output)


def combine(shards: list[str] | list[Path], output: str | Path, *,
            overwrite: bool = False) -> dict:
    """Write a manifest (``output``, ``.json``) that makes prepared files one dataset."""
    output = Path(output)
    check_output(output, overwrite, example="all.json", inputs=shards)
    check_inputs_once([str(s) for s in shards])
    if output.suffix != ".json":
        raise DataError(f"a manifest's name ends in .json, not {output.name}; e.g. "
                        f"--output {output.with_suffix('.json')}")
    infos = [read_info(s) for s in shards]
    first = infos[0]
    entries = []
    for info in infos:
        if len(info.files) != 1:
            raise DataError(f"{info.path} is a manifest; combine token files (.h5) only")
        if info.tokenizer_meta != first.tokenizer_meta:
            raise DataError(f"{info.path} and {first.path} have different vocabularies; "
                            "shards must share one tokenizer: prepare them with --tokenizer "
                            "byte or gpt2, or as one dataset")
        entry = {"path": os.path.relpath(info.path.resolve(), output.parent.resolve())}
        for name in SPLITS:
            split = info.splits[name]
            entry[f"{name}_tokens"] = split.n_tokens
            entry[f"{name}_crc32"] = _array_checksum(info, name)
        entries.append(entry)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_manifest(output, entries, first.tokenizer_meta, first.splits["train"].dtype)
    chmod_as_created(output)  # written through a 0600 temporary name, like the datasets
    return {"output": str(output), "shards": len(entries),
            "train_tokens": sum(e["train_tokens"] for e in entries),
            "val_tokens": sum(e["val_tokens"] for e in entries)}


def _array_checksum(info, name: str) -> int:
    part = info.splits[name].parts[0]
    return checksum_from_blocks(part.crc32, part.n_tokens * info.splits[name].dtype.itemsize,
                                part.block_bytes)
