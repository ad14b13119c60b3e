"""Reading one unit of work (``sources.py``) as batches of documents, with bounded memory.

``read_unit`` yields lists of document strings and a reader holds one batch at a time:
about ``BLOCK_BYTES`` of documents (JSON lines, Parquet rows, Arrow rows), plus the one
that passes the mark; a text file is one document of the whole file. Nothing longer than
the limits of ``hpctrain.sizes`` (a document, a JSON line, a text file) is held: it fails
the command with its location (``bounded_read.py`` cuts the lines). A record that
is not a document is a *bad record*: ``BadRecords`` counts them and keeps the first few
locations, and ``prepare`` skips or fails on them (``--on-bad-record``). ``pyarrow`` and
``zstandard`` are the optional ``corpora`` extra.
The memory bound and what makes a record bad: docs/design/data-path.md ("Parallel preparation").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hpctrain.data.bounded_read import gzip_chunks, line_end, lines, plain_chunks, zstd_chunks
from hpctrain.data.sources import ARROW, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, TEXT
from hpctrain.errors import DataError
from hpctrain.data.parquet_pages import DICTIONARY_PAGE, chunk_pages
from hpctrain.sizes import (MAX_DOCUMENT_BYTES, MAX_LINE_BYTES, MAX_PAGE_BYTES,
                            MAX_TEXT_FILE_BYTES, MiB)

BLOCK_BYTES = MiB
BATCH_ROWS = 1024
"""The most rows of a Parquet row group read at a time (fewer where its rows are long)."""
DICTIONARY_READ_BYTES = 64 * MiB
"""The most uncompressed bytes of a Parquet text column read as a dictionary (``_read_plan``)."""
SHOWN_BAD = 5  # locations kept for the message
_EXTRA = {PARQUET: "pyarrow", ARROW: "pyarrow", JSONL_ZST: "zstandard"}


@dataclass
class BadRecords:
    """How many bad records a rank met, and where the first ``SHOWN_BAD`` were."""
    count: int = 0
    first: list[str] = field(default_factory=list)

    def add(self, where: str, why: str) -> None:
        self.count += 1
        if len(self.first) < SHOWN_BAD:
            self.first.append(f"{where}: {why}")

    @staticmethod
    def merged(parts: list[tuple[int, list[str]]]) -> "BadRecords":
        """Every rank's ``(count, first)`` in rank order as one record."""
        out = BadRecords()
        for count, first in parts:
            out.count += count
            out.first += first[:SHOWN_BAD - len(out.first)]
        return out

    def message(self) -> str:
        return (f"{self.count:,} bad record(s) in the input (first: {'; '.join(self.first)})")


def require_extra(fmt: str, path: str) -> None:
    """The optional package that reads ``fmt``, or one line naming how to install it."""
    package = _EXTRA.get(fmt)
    if package is None:
        return
    try:
        __import__(package)
    except ImportError:
        raise DataError(f"reading {path} needs the {package} package: "
                        f"pip install 'hpctrain[corpora]' (or pip install {package})") from None


def parquet_row_group_bytes(path: str, text_field: str) -> list[int]:
    """The on-disk size of each row group of a Parquet file, after checking that its text
    column exists and holds strings (read from the footer only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e})") from None
    _check_column(meta.schema_arrow, path, text_field)
    md = meta.metadata
    return [sum(md.row_group(g).column(c).total_compressed_size
                for c in range(md.row_group(g).num_columns)) for g in range(md.num_row_groups)]


def _check_column(schema, path: str, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise DataError(f"{path} has no column {text_field!r} (its columns: "
                        f"{', '.join(schema.names)}); name the text column with --text-field")
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):  # a categorical column of text (pandas writes them)
        kind = kind.value_type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):
        raise DataError(f"column {text_field!r} of {path} holds {kind}, not text; name the "
                        "text column with --text-field")


def read_unit(path: str, fmt: str, start: int, stop: int, text_field: str,
              bad: BadRecords, raw_text: bool = False) -> Iterator[list]:
    """Batches of documents of one unit (``sources.plan_units``); a text file's whole
    content is one batch of one document (``bytes`` if ``raw_text``)."""
    if fmt == TEXT:
        yield [_read_text(path, raw_text)]
    elif fmt == JSONL:
        yield from _jsonl_range(path, start, stop, text_field, bad)
    elif fmt in (JSONL_GZ, JSONL_ZST):
        require_extra(fmt, path)
        chunks = gzip_chunks(path) if fmt == JSONL_GZ else zstd_chunks(path)
        yield from _jsonl_lines(chunks, path, 0, lambda: 0, 1 << 62, text_field, bad)
    elif fmt == PARQUET:
        yield from _parquet_row_groups(path, start, stop, text_field, bad)
    elif fmt == ARROW:
        yield from _arrow_batches(path, text_field, bad)
    else:
        raise ValueError(f"unknown format {fmt!r}")


def _too_large(where: str, what: str, limit: int, name: str, fix: str) -> DataError:
    """The one message for a document over one of hpctrain's size limits."""
    return DataError(f"{where} holds {what} over {limit:,} bytes ({limit / MiB:g} MiB), the "
                     f"most hpctrain takes (a limit of hpctrain's, hpctrain.sizes.{name}); {fix}")


_SPLIT = "split that document into smaller ones"


def _read_text(path: str, raw: bool):
    size = os.stat(path).st_size
    if size > MAX_TEXT_FILE_BYTES:
        raise _too_large(path, f"{size:,} bytes: a text file is one document, and that is",
                        MAX_TEXT_FILE_BYTES, "MAX_TEXT_FILE_BYTES",
                        "split it into smaller files or give its documents as JSON lines")
    data = Path(path).read_bytes()
    check_looks_like_text(path, data)
    if raw:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); convert "
                        "it to UTF-8 (e.g. iconv -t UTF-8), or use --tokenizer byte, which "
                        "takes the bytes as they are") from None


BINARY_PROBE_BYTES = 8000
"""A NUL byte this early makes a file binary (git's rule): text never holds one."""


def check_looks_like_text(path: str, data: bytes) -> None:
    """Refuse a binary file given as text: a token file (nanoGPT's ``train.bin``) or an
    archive would become millions of tokens of garbage under any tokenizer."""
    at = data.find(b"\0", 0, BINARY_PROBE_BYTES)
    if at >= 0:
        raise DataError(f"{path} is binary, not text (a NUL byte at offset {at}); token "
                        "files go through --format (nanoGPT's .bin: --format nanogpt-bin; "
                        "Megatron's .bin/.idx: --format megatron), text in UTF-16 or "
                        "another encoding must be converted to UTF-8 first")


def _jsonl_range(path: str, start: int, stop: int, text_field: str,
                 bad: BadRecords) -> Iterator[list]:
    """The lines that start in bytes ``[start, stop)`` of a plain JSON-lines file."""
    with open(path, "rb") as f:
        # the line running through ``start - 1`` belongs to the range before
        pos = line_end(f, start - 1) if start > 0 else 0
        f.seek(pos)

        def first_line_number() -> int:  # only asked when a location is needed
            return _count_newlines(path, pos)
        yield from _jsonl_lines(plain_chunks(f), path, pos, first_line_number, stop,
                                text_field, bad)


def _count_newlines(path: str, end: int) -> int:
    n = 0
    with open(path, "rb") as f:
        while f.tell() < end:
            n += f.read(min(BLOCK_BYTES, end - f.tell())).count(b"\n")
    return n


def _jsonl_lines(chunks, path: str, pos: int, lines_before, stop: int, text_field: str,
                 bad: BadRecords) -> Iterator[list]:
    """Documents of the lines of ``chunks`` that start before byte ``stop`` (``pos`` is
    where the chunks start; ``lines_before()`` how many lines precede it in the file)."""
    base: list[int] = []  # lines_before(), asked once and only for a location

    def line_number(k: int) -> int:
        base[:] = base or [lines_before()]
        return base[0] + k

    def too_long(k: int):
        raise _too_large(f"{path}:line {line_number(k)}", "a JSON line", MAX_LINE_BYTES,
                        "MAX_LINE_BYTES", _SPLIT)
    batch, held, k = [], 0, 0
    for line in lines(chunks, MAX_LINE_BYTES, too_long):
        if pos >= stop:
            break
        pos += len(line)
        k += 1
        text, why = _document(line, text_field)
        if why:
            bad.add(f"{path}:line {line_number(k)}", why)
        elif text is not None:
            if _utf8_over(text, MAX_DOCUMENT_BYTES):
                raise _too_large(f"{path}:line {line_number(k)}", "a document",
                                MAX_DOCUMENT_BYTES, "MAX_DOCUMENT_BYTES", _SPLIT)
            batch.append(text)
            held += len(line)
            if held >= BLOCK_BYTES:
                yield batch
                batch, held = [], 0
    if batch:
        yield batch


def _utf8_over(text: str, limit: int) -> bool:
    """Whether ``text`` takes more than ``limit`` bytes in UTF-8 (4 at most a character)."""
    if len(text) * 4 <= limit:
        return False
    return len(text) > limit or (not text.isascii() and len(text.encode("utf-8")) > limit)


def _document(line: bytes, text_field: str) -> tuple[str | None, str | None]:
    """(the document, None), (None, why it is bad) or (None, None) for a blank line."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"undecodable bytes (not UTF-8 at byte {e.start} of the line)"
    if not decoded.strip():
        return None, None
    try:
        obj = json.loads(decoded)
    except ValueError as e:
        return None, f"invalid JSON ({e})"
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    if text_field not in obj:
        return None, f"no field {text_field!r} (fields: {', '.join(list(obj)[:8])})"
    value = obj[text_field]
    if not isinstance(value, str):
        return None, f"field {text_field!r} is {_json_type(value)}, not a string"
    if b"\\u" in line and not value.isascii():  # only an escape can make a lone surrogate
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return None, f"undecodable text (a lone surrogate escape at character {e.start})"
    return value, None


def _json_type(value) -> str:
    return "null" if value is None else {bool: "a boolean", int: "a number", float: "a number",
                                         list: "an array", dict: "an object"}[type(value)]


def _column_documents(values: list, where, bad: BadRecords) -> list[str]:
    """The strings of one batch of a text column (``bytes`` from a binary column are
    decoded); ``where(i)`` names row ``i`` of the batch."""
    docs = []
    for i, value in enumerate(values):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.add(where(i), f"undecodable bytes (not UTF-8 at byte {e.start})")
                continue
        if value is None:
            bad.add(where(i), "null, not a string")
        else:
            docs.append(value)
    return docs


def _column_batches(column, where, bad: BadRecords) -> Iterator[list]:
    """The documents of one record batch's text column, in runs of about ``BLOCK_BYTES``;
    a value over ``MAX_DOCUMENT_BYTES`` fails before any value becomes a Python string.
    ``where(i)`` names row ``i`` of the batch."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(column.type):  # a row's length without decoding it
        sizes = pc.take(pc.binary_length(column.dictionary), column.indices)
    else:
        sizes = pc.binary_length(column)
    sizes = sizes.fill_null(0).to_numpy(zero_copy_only=False)
    over = np.flatnonzero(sizes > MAX_DOCUMENT_BYTES)
    if over.size:
        raise _too_large(where(int(over[0])), "a document", MAX_DOCUMENT_BYTES,
                        "MAX_DOCUMENT_BYTES", _SPLIT)
    ends, i = np.cumsum(sizes), 0
    while i < len(sizes):  # rows i..j-1: the first run that reaches BLOCK_BYTES
        j = min(len(sizes), 1 + int(np.searchsorted(ends, ends[i] - sizes[i] + BLOCK_BYTES)))
        docs = _column_documents(column.slice(i, j - i).to_pylist(),
                                 lambda r, i=i: where(i + r), bad)
        if docs:
            yield docs
        i = j


def _parquet_row_groups(path: str, start: int, stop: int, text_field: str,
                        bad: BadRecords) -> Iterator[list]:
    require_extra(PARQUET, path)
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with pq.ParquetFile(path) as plain, open(path, "rb") as raw, \
                pq.ParquetFile(path, read_dictionary=[text_field]) as coded:
            for g in range(start, stop):
                rows, as_dictionary = _read_plan(raw, coded, g, text_field,
                                                 f"{path}:row group {g}")
                row = 0
                for batch in (coded if as_dictionary else plain).iter_batches(
                        batch_size=rows, row_groups=[g], columns=[text_field],
                        use_threads=False):
                    first = row
                    yield from _column_batches(
                        batch.column(0),
                        lambda i, first=first, g=g: f"{path}:row group {g}:row {first + i}", bad)
                    row += batch.num_rows
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(_unreadable(path, "Parquet", e)) from None


def _read_plan(raw, coded, g: int, text_field: str, where: str) -> tuple[int, bool]:
    """How to read row group ``g``'s text column, from its page headers (``raw``: the
    file): the rows of a batch, and whether to read it as a dictionary (``coded`` reads
    so). A page that decompresses past ``MAX_PAGE_BYTES`` fails first. A batch holds
    about ``BLOCK_BYTES`` at the densest page's bytes per value (at most ``BATCH_ROWS``
    rows): its rows then take at most that plus the two pages it begins and ends in.
    A dictionary-encoded page may repeat one long value in every row: read as a
    dictionary, the value is held once and each row's length is known before it is
    decoded. Pages written plain after the dictionary (a writer's fallback) add to that
    dictionary, so a column over ``DICTIONARY_READ_BYTES`` is read plainly, each row
    counted as long as the dictionary's longest value."""
    import pyarrow.compute as pc

    row_group = coded.metadata.row_group(g)
    chunk = next((row_group.column(c) for c in range(row_group.num_columns)
                  if row_group.column(c).path_in_schema == text_field), None)
    if chunk is None:
        return BATCH_ROWS, False
    pages = chunk_pages(raw, chunk)
    largest = max((size for _, size, _ in pages), default=0)
    if largest > MAX_PAGE_BYTES:
        raise _too_large(where, f"a page of {largest:,} bytes decompressed,", MAX_PAGE_BYTES,
                        "MAX_PAGE_BYTES", "split its documents into smaller ones")
    per_value = max((size / max(n, 1) for kind, size, n in pages if kind != DICTIONARY_PAGE),
                    default=1.0)
    as_dictionary = (chunk.has_dictionary_page
                     and chunk.total_uncompressed_size <= DICTIONARY_READ_BYTES)
    if chunk.has_dictionary_page and not as_dictionary:  # one row: just the dictionary page
        first = next(coded.iter_batches(batch_size=1, row_groups=[g], columns=[text_field],
                                        use_threads=False), None)
        if first is not None and hasattr(first.column(0), "dictionary"):
            longest = pc.max(pc.binary_length(first.column(0).dictionary)).as_py()
            per_value = max(per_value, longest or 0)
    return max(1, min(BATCH_ROWS, int(BLOCK_BYTES // max(per_value, 1)))), as_dictionary


def _unreadable(path: str, kind: str, e: Exception) -> str:
    why = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return (f"{path} cannot be read as {kind} ({why}): the file is truncated or corrupt; "
            "copy or write it again")


def _arrow_batches(path: str, text_field: str, bad: BadRecords) -> Iterator[list]:
    require_extra(ARROW, path)
    import pyarrow as pa

    try:
        row = 0
        for batch in _arrow_record_batches(path, text_field):
            first = row
            yield from _column_batches(batch.column(text_field),
                                       lambda i, first=first: f"{path}:row {first + i}", bad)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(_unreadable(path, "Arrow", e)) from None


_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _arrow_record_batches(path: str, text_field: str):
    """The record batches of an Arrow IPC stream (what ``datasets`` writes) or file. A
    stream must end with its end-of-stream marker: one cut after a whole record batch
    would otherwise read as a shorter stream."""
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        stream = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:  # the random-access file format, or not Arrow at all
        stream = None
    if stream is not None:
        _check_column(stream.schema, path, text_field)
        yield from stream
        with open(path, "rb") as f:
            f.seek(max(0, os.stat(path).st_size - len(_END_OF_STREAM)))
            if f.read() != _END_OF_STREAM:
                raise DataError(_unreadable(path, "Arrow", "no end-of-stream marker"))
        return
    try:
        file = pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        raise DataError(f"{path} is neither an Arrow IPC stream nor an Arrow IPC file; "
                        "give .arrow only to Arrow data (datasets.save_to_disk writes it)"
                        ) from None
    _check_column(file.schema, path, text_field)
    for i in range(file.num_record_batches):
        yield file.get_batch(i)
