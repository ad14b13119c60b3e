"""The pages of one Parquet column chunk, read from their headers alone: how many bytes
each decompresses to and how many values it holds. A reader can then refuse a page that
would decompress past a limit, and size its batches, before any page is decompressed
(the footer gives only the chunk's total, and a page of one long value may hold it all).

A page header is a Thrift struct in the compact protocol (parquet-format's
``PageHeader``). It is parsed from the file as a stream: a binary field (statistics may
hold a whole value) is skipped by seeking, never read.
"""

from __future__ import annotations

DICTIONARY_PAGE = 2
"""``PageHeader.type`` of a dictionary page (parquet-format's ``PageType``)."""
_DATA_HEADERS = (5, 7, 8)  # data_page_header, dictionary_page_header, data_page_header_v2


def chunk_pages(f, chunk) -> list[tuple[int, int, int]]:
    """``(page type, uncompressed bytes, values)`` of every page of ``chunk`` (pyarrow's
    ``ColumnChunkMetaData``) in the open binary file ``f``; ValueError if a header is
    not one."""
    first = chunk.data_page_offset
    if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < first:
        first = chunk.dictionary_page_offset
    end, pages = first + chunk.total_compressed_size, []
    f.seek(first)
    while f.tell() < end:
        header = _struct(f, 0)
        kind, size, stored = header.get(1), header.get(2), header.get(3)
        if not all(isinstance(v, int) and v >= 0 for v in (kind, size, stored)):
            raise ValueError(f"no page header at byte {f.tell()}")
        values = next((h.get(1, 0) for k, h in header.items()
                       if k in _DATA_HEADERS and isinstance(h, dict)), 0)
        pages.append((kind, size, values))
        f.seek(stored, 1)
    return pages


def _varint(f) -> int:
    shift = result = 0
    while True:
        byte = f.read(1)
        if not byte:
            raise ValueError("a page header runs past the end of the file")
        result |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError("a varint of a page header is too long")


def _zigzag(f) -> int:
    n = _varint(f)
    return (n >> 1) ^ -(n & 1)


def _struct(f, depth: int) -> dict:
    """The fields of a compact-protocol struct: ints, nested structs as dicts; other
    values are skipped and kept as None."""
    if depth > 16:
        raise ValueError("a page header nests too deep")
    fields, last = {}, 0
    while (byte := f.read(1)) and byte[0] != 0:
        kind, delta = byte[0] & 0x0F, byte[0] >> 4
        last = last + delta if delta else _zigzag(f)
        fields[last] = _value(f, kind, depth)
    if not byte:
        raise ValueError("a page header runs past the end of the file")
    return fields


def _value(f, kind: int, depth: int):
    if kind in (1, 2):  # booleans: the value is the type
        return kind == 1
    if kind in (4, 5, 6):
        return _zigzag(f)
    if kind == 3 or kind == 7:  # a byte, a double
        f.seek(1 if kind == 3 else 8, 1)
    elif kind == 8:  # binary: skipped, whatever its length
        f.seek(_varint(f), 1)
    elif kind in (9, 10):  # list, set
        head = _byte(f)
        count = head >> 4 if head >> 4 != 15 else _varint(f)
        for _ in range(count):
            _element(f, head & 0x0F, depth)
    elif kind == 11:  # map
        count = _varint(f)
        types = _byte(f) if count else 0
        for _ in range(count):
            _element(f, types >> 4, depth)
            _element(f, types & 0x0F, depth)
    elif kind == 12:
        return _struct(f, depth + 1)
    else:
        raise ValueError(f"unknown Thrift type {kind} in a page header")
    return None


def _element(f, kind: int, depth: int) -> None:
    if kind in (1, 2):  # a boolean element is one byte
        f.seek(1, 1)
    else:
        _value(f, kind, depth + 1)


def _byte(f) -> int:
    byte = f.read(1)
    if not byte:
        raise ValueError("a page header runs past the end of the file")
    return byte[0]
