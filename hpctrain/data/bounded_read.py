"""Bytes and lines of an input file in bounded memory, whatever a compressed stream
expands to.

A ``.gz`` or ``.zst`` stream is decompressed a small piece at a time, and it is an error
(``DataError``) unless it ends where a gzip member or zstd frame ends: a truncated or
corrupt stream never passes as a shorter one. Lines are cut from the bytes chunk by chunk
(never with an unbounded ``readline``), and a line over the caller's limit is refused by
its number before more of it is held. The limits: docs/design/data-path.md
("Parallel preparation").
"""

from __future__ import annotations

import gzip
import zlib
from typing import Callable, Iterator

from hpctrain.errors import DataError

CHUNK_BYTES = 64 << 10
"""Bytes asked of a file or a gzip stream at a time."""
ZSTD_FEED_BYTES = 256
"""Compressed bytes given to the zstd decompressor at a time. A zstd block of 4 bytes
(an RLE block) may stand for 128 KiB, so one feed gives at most 8 MiB."""


def plain_chunks(f) -> Iterator[bytes]:
    """The bytes of an open binary file from where it stands, a chunk at a time."""
    while chunk := f.read(CHUNK_BYTES):
        yield chunk


def line_end(f, offset: int) -> int:
    """The offset just past the first newline at or after ``offset`` (or the end of the
    file), read in chunks: the rest of a line is skipped without being held."""
    f.seek(offset)
    for chunk in plain_chunks(f):
        k = chunk.find(b"\n")
        if k >= 0:
            return offset + k + 1
        offset += len(chunk)
    return offset


def gzip_chunks(path: str) -> Iterator[bytes]:
    """The decompressed bytes of a gzip file; a truncated or corrupt one is a DataError."""
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(_broken(path, "gzip", e)) from None


def zstd_chunks(path: str) -> Iterator[bytes]:
    """The decompressed bytes of a zstd file of one or more frames. The file must end
    where a frame ends: one cut inside a frame is refused, not read as a shorter stream."""
    import zstandard

    dctx, frame = zstandard.ZstdDecompressor(), None
    with open(path, "rb") as f:
        for chunk in plain_chunks(f):
            view = memoryview(chunk)
            for at in range(0, len(view), ZSTD_FEED_BYTES):
                data = view[at:at + ZSTD_FEED_BYTES]
                while data:
                    frame = frame or dctx.decompressobj()
                    try:
                        out = frame.decompress(data)
                    except zstandard.ZstdError as e:
                        raise DataError(_broken(path, "zstd", e)) from None
                    if out:
                        yield out
                    data, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise DataError(_broken(path, "zstd", "it ends inside a frame"))


def _broken(path: str, kind: str, why) -> str:
    return (f"{path} is not a complete {kind} stream ({why}): the file is truncated or "
            "corrupt; copy or write it again")


def lines(chunks: Iterator[bytes], limit: int,
          too_long: Callable[[int], None]) -> Iterator[bytes]:
    """The lines of ``chunks`` (each with its newline, the last one perhaps without).
    ``too_long(k)`` is called, and must raise, as soon as line ``k`` (1 for the first
    line) is known to hold more than ``limit`` bytes besides its newline."""
    held, size, k = [], 0, 0
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            k += 1
            if size + end - start > limit:
                too_long(k)
            yield b"".join(held) + chunk[start:end + 1] if held else chunk[start:end + 1]
            held, size, start = [], 0, end + 1
        if start < len(chunk):
            held.append(chunk[start:])
            size += len(chunk) - start
            if size > limit:
                too_long(k + 1)
    if held:
        yield b"".join(held)
