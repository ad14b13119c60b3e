"""``hpctrain prepare --format nanogpt-bin|megatron``: token files made by other tools ->
one HDF5 token file (``format.py``), without the text, on one process or every rank.

A nanoGPT ``.bin`` is a raw little-endian uint16 array of token ids; Megatron-LM's pair
``prefix.bin`` + ``prefix.idx`` is read through ``megatron_index.py``. Rank 0 checks the
inputs and chooses the split: two nanoGPT files named ``train.bin`` and ``val.bin`` are
the splits; a single file gives validation whole documents from ``STRIPES`` places along
it, each cut at the document starts nearest its share of the ``--val-fraction`` target
(nanoGPT: after an end-of-text id; Megatron: a start in ``doc_idx``), so that a sorted
input is sampled all along. Then each rank takes an equal run of every split's
tokens, checks every id against the vocabulary and checksums its run, and the file is
written as ``prepare.py`` writes one (its header, collective MPI-IO writes, the read-back,
the rename): the same bytes at any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpctrain.data.format import SPLITS, create_token_file, token_dtype
from hpctrain.data.megatron_index import megatron_prefix, read_megatron_index
from hpctrain.data.prepare import (DEFAULT_TIMEOUT_S, WRITE_CHUNK_BYTES, check_inputs_once,
                                   check_output, crc_pieces, join_crc_pieces,
                                   write_token_file)
from hpctrain.data.prepare_group import Group, Solo, attempt
from hpctrain.data.tokenizers import GPT2Tokenizer, IdsTokenizer
from hpctrain.errors import DataError
from hpctrain.sizes import MAX_VOCAB, MAX_WAIT_S, MiB, finite, whole

FORMATS = ("nanogpt-bin", "megatron")
GPT2_VOCAB, GPT2_EOT = 50257, 50256
SPLIT_RULES = {"single": "striped-documents", "files": "train-val-files"}
STRIPES = 16
"""Places along a single input that give the validation split its documents: an input in
sorted order (by source, by date) is sampled all along, not only at its end."""
CHUNK_BYTES = WRITE_CHUNK_BYTES
"""Output bytes a rank checks, converts and writes at a time (its memory besides MPI's)."""
SCAN_TOKENS = MiB
"""Tokens read at a time on each side while looking for the cut (memory: that many bytes)."""
HDF5_MAGIC, LLMC_MAGIC = b"\x89HDF\r\n\x1a\n", 20240520


@dataclass(frozen=True)
class Segment:
    """One split's tokens: the ``ranges`` ``[first, count]`` of ``path`` (values of
    ``dtype``), one after the other."""
    path: str
    dtype: str
    ranges: list

    @property
    def count(self) -> int:
        return sum(count for _, count in self.ranges)

    def pieces(self, lo: int, hi: int, itemsize: int):
        """Tokens ``[lo, hi)`` of the split as (first token in the file, first token in
        the split, count), each within one range and of at most ``CHUNK_BYTES`` written
        at ``itemsize`` bytes a token."""
        step, pos = max(1, CHUNK_BYTES // itemsize), 0
        for first, count in self.ranges:
            for at in range(max(lo, pos), min(hi, pos + count), step):
                yield first + at - pos, at, min(hi, pos + count, at + step) - at
            pos += count

    def tokens(self, first: int, count: int) -> np.ndarray:
        """Tokens ``[first, first + count)`` of the file (a view of it)."""
        mm = np.memmap(self.path, np.dtype(self.dtype), "r", shape=(first + count,))
        return mm[first:first + count]


def vocabulary(fmt: str, vocab_size: int | None, eot_id: int | None) -> tuple[int, int | None]:
    """The vocabulary size and end-of-text id: as given, else GPT-2's for a nanoGPT file
    (50257 and 50256, nanoGPT's own), the end-of-text 50256 wherever the size is 50257;
    a Megatron index records neither, so its size must be given."""
    if fmt not in FORMATS:
        raise DataError(f"--format is one of {', '.join(FORMATS)}, not {fmt!r}")
    if vocab_size is None:
        if fmt == "megatron":
            raise DataError("a Megatron index records no vocabulary size; pass --vocab-size "
                            "(the tokenizer's: 50257 for GPT-2) and --eot-id")
        vocab_size = GPT2_VOCAB
    whole(vocab_size, "--vocab-size", 1, MAX_VOCAB, error=DataError)
    if eot_id is None and vocab_size == GPT2_VOCAB:
        eot_id = GPT2_EOT
    if eot_id is not None:
        whole(eot_id, "--eot-id", 0, vocab_size - 1, error=DataError,
              fix="the end-of-text id is one of the vocabulary's ids")
    return vocab_size, eot_id


def tokenizer_meta(fmt: str, vocab_size: int, eot_id: int | None) -> dict:
    """GPT-2's ids record the gpt2 tokenizer (training and ``sample`` decode them); any
    other vocabulary what is known of it, which decodes nothing (``IdsTokenizer``)."""
    if (vocab_size, eot_id) == (GPT2_VOCAB, GPT2_EOT):
        return GPT2Tokenizer().meta()
    return IdsTokenizer(vocab_size, eot_id, fmt).meta()


def import_tokens(inputs: list[str], output: str | Path, *, fmt: str,
                  vocab_size: int | None = None, eot_id: int | None = None,
                  val_fraction: float = 0.1, comm=None, romio_hints: dict | None = None,
                  overwrite: bool = False, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Convert ``inputs`` (``fmt``) into ``output``; return a summary dict like
    ``prepare``'s. With ``comm`` every rank calls this with the same arguments."""
    finite(timeout, "--timeout", 0.0, MAX_WAIT_S, low_open=True, error=DataError)
    vocab, eot = vocabulary(fmt, vocab_size, eot_id)
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be between 0 and 1, not {val_fraction}")
    group = Solo() if comm is None else Group(comm, timeout)
    output = Path(output)

    def find():
        return _find(inputs, output, overwrite, fmt, eot, val_fraction) \
            if group.rank == 0 else None
    plan = group.bcast(attempt(group, find, "reading the inputs"), "the inputs")
    segments = {name: Segment(**plan["segments"][name]) for name in SPLITS}
    dtype = np.dtype(token_dtype(vocab)).newbyteorder("<")
    runs = {name: _run(seg.count, group.rank, group.size) for name, seg in segments.items()}
    pieces = attempt(group, lambda: {name: _check_run(segments[name], runs[name], vocab,
                                                      dtype, fmt) for name in SPLITS},
                     "checking the token ids")
    gathered = group.allgather(pieces, "checksums")
    counts = _Counts(dtype, {name: seg.count for name, seg in segments.items()})
    meta = tokenizer_meta(fmt, vocab, eot)

    def header(tmp):
        crcs = {name: join_crc_pieces([p for g in gathered for p in g[name]],
                                      n * dtype.itemsize)
                for name, n in counts.n_tokens.items()}
        return create_token_file(tmp, n_tokens=counts.n_tokens, dtype=dtype,
                                 tokenizer_meta=meta, crcs=crcs, sources=plan["files"],
                                 split=plan["split"], source_tokens=plan["source_tokens"])
    write_token_file(group, output, romio_hints or {}, counts, header,
                      rounds=lambda g, _c, offsets: _rounds(g, segments, runs, dtype, offsets))
    group.barrier("barrier after publishing the file")
    n_train, n_val = counts.n_tokens["train"], counts.n_tokens["val"]
    return {"output": str(output), "files": len(plan["files"]), "tokens": n_train + n_val,
            "train_tokens": n_train, "val_tokens": n_val, "vocab_size": vocab,
            "tokenizer": meta["name"], "ranks": group.size, "format": fmt}


@dataclass
class _Counts:
    """What ``prepare``'s writer reads of a split: the token type and each split's size."""
    dtype: np.dtype
    n_tokens: dict[str, int]


def _run(count: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s tokens ``[lo, hi)`` of a split of ``count``: equal runs in order."""
    return count * rank // size, count * (rank + 1) // size


def _check_run(seg: Segment, run: tuple[int, int], vocab: int, dtype: np.dtype,
               fmt: str) -> list:
    """Every id of this rank's run below ``vocab`` (and not negative), else one message
    naming the file and the position; returns the run's checksum pieces."""
    pieces = []
    for first, at, count in seg.pieces(*run, dtype.itemsize):
        ids = seg.tokens(first, count)
        if ids.size and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            k = int(np.flatnonzero((ids >= vocab) | (ids < 0))[0])
            pos = first + k
            raise DataError(
                f"{seg.path}: token {pos:,} (byte {pos * np.dtype(seg.dtype).itemsize:,}) is "
                f"{int(ids[k])}, not an id of a vocabulary of {vocab}; pass the "
                f"tokenizer's --vocab-size (above every id), or check that the file is a "
                f"{fmt} token file")
        out = memoryview(np.ascontiguousarray(ids.astype(dtype, copy=False))).cast("B")
        pieces += crc_pieces(out, at * dtype.itemsize)
    return pieces


def _rounds(group, segments: dict, runs: dict, dtype: np.dtype, offsets: dict) -> _Rounds:
    """The writes of this rank's runs, one chunk a round, as many rounds on every rank."""
    mine = [(offsets[name] + at * dtype.itemsize, segments[name], first, count)
            for name in SPLITS
            for first, at, count in segments[name].pieces(*runs[name], dtype.itemsize)]
    return _Rounds(mine, dtype, max(group.allgather(len(mine), "write rounds")))


class _Rounds:
    """``prepare``'s rounds of ``(byte offset, bytes)``, each chunk read and converted
    only when its round comes (memory: one chunk), then empty rounds up to ``n``."""

    def __init__(self, chunks: list, dtype: np.dtype, n: int):
        self.chunks, self.dtype, self.n = chunks, dtype, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        for offset, seg, first, count in self.chunks:
            ids = np.ascontiguousarray(seg.tokens(first, count).astype(self.dtype, copy=False))
            yield [(offset, memoryview(ids).cast("B"))]
        for _ in range(self.n - len(self.chunks)):
            yield []


# ------------------------------------------------------------------ rank 0: the inputs

def _find(inputs: list[str], output: Path, overwrite: bool, fmt: str, eot: int | None,
          val_fraction: float) -> dict:
    """Check the inputs and the output; the files, each split's segment, the split rule
    and each file's (train, val) tokens, as JSON for the other ranks."""
    if fmt == "megatron":  # the pair is checked as it is read
        return _find_megatron(inputs, output, overwrite, val_fraction)
    for name in inputs:
        if not Path(name).is_file():
            raise DataError(f"input {name} is not a file; --format nanogpt-bin reads one "
                            ".bin, or train.bin and val.bin")
    check_output(output, overwrite, inputs=inputs)
    check_inputs_once(list(inputs))
    sizes = [_nanogpt_tokens(name) for name in inputs]
    if len(inputs) == 2:
        by_stem = {Path(n).stem: (n, s) for n, s in zip(inputs, sizes)}
        if set(by_stem) != {"train", "val"}:
            raise DataError(f"two nanoGPT files are the splits, named train.bin and val.bin, "
                            f"not {', '.join(Path(n).name for n in inputs)}; or give one file")
        for name in SPLITS:
            _enough(by_stem[name][1], f"{by_stem[name][0]} ({name})")
        segs = {name: _segment(by_stem[name][0], "<u2", [[0, by_stem[name][1]]])
                for name in SPLITS}
        files = [by_stem["train"][0], by_stem["val"][0]]
        return {"files": files, "segments": segs, "split": {"rule": SPLIT_RULES["files"]},
                "source_tokens": [[by_stem["train"][1], 0], [0, by_stem["val"][1]]]}
    if len(inputs) != 1:
        raise DataError(f"--format nanogpt-bin takes one .bin (split at end-of-text ids) or "
                        f"train.bin and val.bin, not {len(inputs)} files")
    name, n = inputs[0], sizes[0]
    _enough(n, name, 4)
    if eot is None:
        raise DataError(f"{name} is split into train and val at end-of-text ids: pass "
                        "--eot-id, or give train.bin and val.bin")
    val = _val_ranges(n, val_fraction, lambda target, low, high: _nearest_eot_boundary(
        name, n, eot, target, low, high))
    if not val:
        raise DataError(f"{name} has no end-of-text id {eot} to split train and val at; "
                        "pass the right --eot-id, or give train.bin and val.bin")
    return _striped_plan(name, "<u2", n, val, {"eot_id": eot, "val_fraction": val_fraction})


def _find_megatron(inputs: list[str], output: Path, overwrite: bool,
                   val_fraction: float) -> dict:
    prefixes = sorted({megatron_prefix(name) for name in inputs})
    if len(prefixes) != 1:
        raise DataError(f"--format megatron converts one .bin/.idx pair, not {len(prefixes)} "
                        f"({', '.join(prefixes)}); convert each and list them with --combine")
    check_output(output, overwrite, inputs=[prefixes[0] + ".bin", prefixes[0] + ".idx"])
    index = read_megatron_index(prefixes[0])
    n = index.n_tokens
    val = _val_ranges(n, val_fraction, index.nearest_document_start)
    if not val:
        raise DataError(f"{index.idx_path} has no document start to split train and val at "
                        f"({index.n_documents:,} document(s), {n:,} tokens); it needs two "
                        "documents of at least two tokens")
    return _striped_plan(str(index.bin_path), index.dtype.str, n, val,
                         {"documents": "doc_idx", "val_fraction": val_fraction})


def _val_ranges(n: int, val_fraction: float, nearest) -> list[list[int]]:
    """The validation split of one input of ``n`` tokens, as ``[first, count]`` ranges of
    whole documents: in each of ``STRIPES`` equal parts of the input, the documents from
    the start nearest (the part's end - its share of the ``--val-fraction`` tokens) to the
    start nearest the part's end (the last part: to the end of the input). ``nearest(
    target, low, high)`` is the document start nearest ``target`` in ``[low, high]``, the
    earlier on a tie, or None. The train split keeps the first two tokens or more."""
    n_val, ranges, low = n - int(n * (1.0 - val_fraction)), [], 2
    for i in range(1, STRIPES + 1):
        end = n * i // STRIPES
        share = n_val * i // STRIPES - n_val * (i - 1) // STRIPES
        first = nearest(end - share, low, n - 2)
        if first is None:
            break
        last = n if i == STRIPES else nearest(end, first, n - 2)
        if last > first:
            ranges.append([first, last - first])
        low = last
    return ranges


def _striped_plan(path: str, dtype: str, n: int, val: list, rule: dict) -> dict:
    """The plan of one input whose validation ranges are ``val``: train is the rest."""
    train, pos = [], 0
    for first, count in val:
        if first > pos:
            train.append([pos, first - pos])
        pos = first + count
    if pos < n:
        train.append([pos, n - pos])
    n_val = sum(count for _, count in val)
    _enough(n_val, f"the validation split of {path}")
    segs = {"train": _segment(path, dtype, train), "val": _segment(path, dtype, val)}
    return {"files": [path], "segments": segs,
            "split": {"rule": SPLIT_RULES["single"], "stripes": STRIPES, **rule},
            "source_tokens": [[n - n_val, n_val]]}


def _segment(path: str, dtype: str, ranges: list) -> dict:
    return {"path": str(path), "dtype": dtype, "ranges": ranges}


def _enough(count: int, what: str, least: int = 2) -> None:
    if count < least:
        raise DataError(f"{what} has {count} token(s): too few for a train and a "
                        "validation split")


def _nanogpt_tokens(name: str) -> int:
    """The uint16 tokens of a nanoGPT file, refusing what is plainly no such file."""
    size = Path(name).stat().st_size
    with open(name, "rb") as f:
        head = f.read(8)
    if head == HDF5_MAGIC:
        raise DataError(f"{name} is an HDF5 file (an hpctrain dataset?), not a nanoGPT .bin; "
                        "train on it with --data.path")
    if len(head) >= 4 and int.from_bytes(head[:4], "little") == LLMC_MAGIC:
        raise DataError(f"{name} starts with llm.c's shard header (magic {LLMC_MAGIC}), not "
                        "nanoGPT's raw uint16 tokens; nanoGPT .bin files have no header")
    if head.startswith(b"MMIDIDX"):
        raise DataError(f"{name} is a Megatron index; use --format megatron")
    if size == 0 or size % 2:
        raise DataError(f"{name} has {size:,} bytes, not a whole number of uint16 tokens: a "
                        "nanoGPT .bin holds 2 bytes per token (is it a text file? prepare "
                        "text without --format)")
    return size // 2


def _nearest_eot_boundary(name: str, n: int, eot: int, target: int, low: int,
                          high: int) -> int | None:
    """The document start (a token after an end-of-text id) nearest ``target`` within
    ``[low, high]``, the earlier on a tie, or None. Read in rings of
    ``SCAN_TOKENS`` on each side of the target, outwards until no unread start could be
    nearer: a file is read near its cut only, in bounded memory."""
    low, high = max(low, 1), min(high, n - 1)  # a start has an end-of-text before it
    target = min(max(target, low), high)
    ids, found = np.memmap(name, np.dtype("<u2"), "r", shape=(n,)), []
    for d in range(0, max(target - low, high - target) + 1, SCAN_TOKENS):
        if found and abs(found[0] - target) < d:
            break
        for a, b in ((target - d - SCAN_TOKENS, target - d),
                     (target + d, target + d + SCAN_TOKENS)):
            a, b = max(a, low), min(b, high + 1)  # starts s in [a, b): ids[s - 1] == eot
            if a < b:
                found += (np.flatnonzero(ids[a - 1:b - 1] == eot) + a).tolist()
        found = sorted(found, key=lambda s: (abs(s - target), s))[:1]
    return found[0] if found else None
