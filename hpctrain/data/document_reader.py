"""Reading one unit of work (``sources.py``) as batches of documents, with bounded memory.

``read_unit`` yields lists of document strings and a reader holds one batch at a time:
about ``BLOCK_BYTES`` of JSON lines, at most ``BATCH_ROWS`` rows of a Parquet row group,
or one Arrow record batch; a text file is one document of the whole file. A record that
is not a document is a *bad record*: ``BadRecords`` counts them and keeps the first few
locations, and ``prepare`` skips or fails on them (``--on-bad-record``). ``pyarrow`` and
``zstandard`` are the optional ``corpora`` extra.
The memory bound and what makes a record bad: docs/design/data-path.md ("Parallel preparation").
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hpctrain.data.sources import ARROW, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, TEXT
from hpctrain.errors import DataError
from hpctrain.sizes import MiB

BLOCK_BYTES = MiB
BATCH_ROWS = 1024
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
        with _open_compressed(path, fmt) as stream:
            yield from _jsonl_lines(stream, path, 0, lambda: 0, 1 << 62, text_field, bad)
    elif fmt == PARQUET:
        yield from _parquet_row_groups(path, start, stop, text_field, bad)
    elif fmt == ARROW:
        yield from _arrow_stream(path, text_field, bad)
    else:
        raise ValueError(f"unknown format {fmt!r}")


def _read_text(path: str, raw: bool):
    data = Path(path).read_bytes()
    if raw:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        "use --tokenizer byte for arbitrary bytes") from None


def _open_compressed(path: str, fmt: str):
    if fmt == JSONL_GZ:
        return gzip.open(path, "rb")
    require_extra(fmt, path)
    import zstandard

    raw = open(path, "rb")
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))


def _jsonl_range(path: str, start: int, stop: int, text_field: str,
                 bad: BadRecords) -> Iterator[list]:
    """The lines that start in bytes ``[start, stop)`` of a plain JSON-lines file."""
    with open(path, "rb") as f:
        pos = start
        if start > 0:  # the line running through ``start - 1`` belongs to the range before
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())

        def first_line_number() -> int:  # only asked when a bad record needs a location
            return _count_newlines(path, pos)
        yield from _jsonl_lines(f, path, pos, first_line_number, stop, text_field, bad)


def _count_newlines(path: str, end: int) -> int:
    n = 0
    with open(path, "rb") as f:
        while f.tell() < end:
            n += f.read(min(BLOCK_BYTES, end - f.tell())).count(b"\n")
    return n


def _jsonl_lines(stream, path: str, pos: int, lines_before, stop: int, text_field: str,
                 bad: BadRecords) -> Iterator[list]:
    """Documents of the lines of ``stream`` that start before byte ``stop`` (``pos`` is
    where the stream stands; ``lines_before()`` how many lines precede it in the file)."""
    batch, held, k, base = [], 0, 0, None
    while pos < stop:
        line = stream.readline()
        if not line:
            break
        pos += len(line)
        k += 1
        text, why = _document(line, text_field)
        if why:
            if base is None:
                base = lines_before()
            bad.add(f"{path}:line {base + k}", why)
        elif text is not None:
            batch.append(text)
            held += len(line)
            if held >= BLOCK_BYTES:
                yield batch
                batch, held = [], 0
    if batch:
        yield batch


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


def _parquet_row_groups(path: str, start: int, stop: int, text_field: str,
                        bad: BadRecords) -> Iterator[list]:
    require_extra(PARQUET, path)
    import pyarrow.parquet as pq

    with pq.ParquetFile(path) as pf:
        for g in range(start, stop):
            row = 0
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g],
                                         columns=[text_field], use_threads=False):
                first = row
                docs = _column_documents(batch.column(0).to_pylist(),
                                         lambda i: f"{path}:row group {g}:row {first + i}", bad)
                row += batch.num_rows
                if docs:
                    yield docs


def _arrow_stream(path: str, text_field: str, bad: BadRecords) -> Iterator[list]:
    require_extra(ARROW, path)
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(pa.memory_map(path))
    except pa.ArrowInvalid:  # the random-access file format instead of a stream
        reader = pa.ipc.open_file(pa.memory_map(path))
        reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        _check_column(reader.schema, path, text_field)
    row = 0
    for batch in reader:
        _check_column(batch.schema, path, text_field)
        first = row
        docs = _column_documents(batch.column(text_field).to_pylist(),
                                 lambda i: f"{path}:row {first + i}", bad)
        row += batch.num_rows
        if docs:
            yield docs
