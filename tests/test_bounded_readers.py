"""``prepare``'s readers in bounded memory whatever an input expands to: a truncated or
corrupt stream is one error, never fewer documents; a JSON line, a document and a text
file over hpctrain's limits (``hpctrain.sizes``) fail by their location before more is
held; Arrow IPC files and streams both read. Limits are lowered here so that hostile
files stay small; the slow test runs the command on gigabytes of NULs at the defaults."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.data import bounded_read, document_reader
from hpctrain.data.document_reader import BadRecords, read_unit
from hpctrain.data.prepare import prepare
from hpctrain.data.sources import file_format
from hpctrain.errors import EXIT_USER_ERROR, DataError
from hpctrain.sizes import MAX_DOCUMENT_BYTES, MAX_LINE_BYTES, MAX_TEXT_FILE_BYTES, MiB

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

LINES = b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(100))
TABLE_DOCS = [f"doc {i}" for i in range(100)]


def docs_of(path: Path) -> list[str]:
    return [d for batch in read_unit(str(path), file_format(path), 0, path.stat().st_size,
                                     "text", BadRecords()) for d in batch]


def _zst_frames(data: bytes) -> tuple[bytes, bytes]:
    c = zstandard.ZstdCompressor()
    return c.compress(data[:len(data) // 2]), c.compress(data[len(data) // 2:])


def _arrow_stream(table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=30)
    return sink.getvalue().to_pybytes()


def _parquet(table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=30)
    return sink.getvalue().to_pybytes()


def _broken_inputs() -> dict[str, tuple[str, bytes]]:
    """name -> (file name, bytes) of inputs cut short or damaged."""
    one, two = _zst_frames(LINES)
    gz = gzip.compress(LINES)
    stream = _arrow_stream(pa.table({"text": TABLE_DOCS}))
    parquet = _parquet(pa.table({"text": TABLE_DOCS}))
    return {
        "zst cut inside its second frame": ("c.jsonl.zst", one + two[:-6]),
        "zst cut inside its only frame": ("c.jsonl.zst", one[:-6]),
        "zst with a corrupt block": ("c.jsonl.zst", one[:20] + b"\xff" * 12 + one[32:] + two),
        "zst that is no zstd": ("c.jsonl.zst", LINES),
        "zst with bytes after its last frame": ("c.jsonl.zst", one + two + b"junk"),
        "gz cut short": ("c.jsonl.gz", gz[:-12]),
        "gz with corrupt data": ("c.jsonl.gz", gz[:30] + b"\0" * 20 + gz[50:]),
        "gz that is no gzip": ("c.jsonl.gz", LINES),
        "arrow stream cut after a record batch": ("c.arrow", stream[:-8]),
        "arrow stream cut inside a record batch": ("c.arrow", stream[:-100]),
        "parquet cut short": ("c.parquet", parquet[:-40]),
    }


@pytest.mark.parametrize("case", list(_broken_inputs()))
def test_a_truncated_or_corrupt_input_is_one_error_never_fewer_documents(tmp_path, case):
    name, data = _broken_inputs()[case]
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataError) as err:
        docs_of(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(path))
    assert "truncated or corrupt" in msg or "not a readable Parquet file" in msg


def test_non_arrow_data_named_arrow_is_one_error(tmp_path):
    path = tmp_path / "c.arrow"
    path.write_bytes(LINES)
    with pytest.raises(DataError, match="neither an Arrow IPC stream nor an Arrow IPC file"):
        docs_of(path)


def test_whole_streams_of_several_frames_and_members_read_every_document(tmp_path):
    (tmp_path / "c.jsonl.zst").write_bytes(b"".join(_zst_frames(LINES)))
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(LINES[:900]) + gzip.compress(LINES[900:]))
    expected = [f"doc {i}" for i in range(100)]
    assert docs_of(tmp_path / "c.jsonl.zst") == expected
    assert docs_of(tmp_path / "c.jsonl.gz") == expected


@pytest.mark.parametrize("fmt", ["file", "stream"])
def test_arrow_ipc_files_and_streams_both_read(tmp_path, fmt):
    table = pa.table({"id": list(range(100)), "text": TABLE_DOCS})
    path = tmp_path / "c.arrow"
    with (pa.ipc.new_file if fmt == "file" else pa.ipc.new_stream)(str(path), table.schema) as w:
        w.write_table(table, max_chunksize=30)  # four record batches
    assert docs_of(path) == TABLE_DOCS


@pytest.fixture
def small_limits(monkeypatch):
    """A line limit of 64 KiB and a document limit of 16 KiB."""
    monkeypatch.setattr(document_reader, "MAX_LINE_BYTES", 64 << 10)
    monkeypatch.setattr(document_reader, "MAX_DOCUMENT_BYTES", 16 << 10)


def _nul_zst(nbytes: int) -> bytes:
    """``nbytes`` NULs, no newline: a few KB of zstd."""
    return zstandard.ZstdCompressor().compress(b"\0" * (64 * MiB)) * (nbytes // (64 * MiB))


def test_a_line_over_the_limit_fails_by_its_number_before_more_of_it_is_read(
        tmp_path, small_limits, monkeypatch):
    handed = []

    def counted(path):
        for chunk in bounded_read.zstd_chunks(path):
            handed.append(len(chunk))
            yield chunk
    monkeypatch.setattr(document_reader, "zstd_chunks", counted)
    path = tmp_path / "nul.jsonl.zst"
    # two lines and the start of a third, which runs on into 256 MiB of NULs
    path.write_bytes(zstandard.ZstdCompressor().compress(LINES[:40]) + _nul_zst(256 * MiB))
    with pytest.raises(DataError) as err:
        docs_of(path)
    assert str(err.value).startswith(f"{path}:line 3 holds a JSON line over 65,536 bytes")
    assert "a limit of hpctrain's, hpctrain.sizes.MAX_LINE_BYTES" in str(err.value)
    # the limit, plus at most what one zstd feed gives (a 4-byte block may stand for
    # 128 KiB): never the 256 MiB behind it
    assert sum(handed) <= (64 << 10) + (128 << 10) // 4 * bounded_read.ZSTD_FEED_BYTES


def test_long_lines_are_located_in_plain_ranges_and_gzip(tmp_path, small_limits):
    lines = LINES.splitlines(keepends=True)
    long = json.dumps({"text": "x" * (80 << 10)}).encode() + b"\n"
    data = b"".join(lines[:50] + [long] + lines[50:])
    (tmp_path / "c.jsonl").write_bytes(data)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(data))
    start = len(b"".join(lines[:40])) + 3  # a range that begins inside line 41
    with pytest.raises(DataError, match=r"c.jsonl:line 51 holds a JSON line over"):
        list(read_unit(str(tmp_path / "c.jsonl"), "jsonl", start, len(data), "text",
                       BadRecords()))
    with pytest.raises(DataError, match=r"c.jsonl.gz:line 51 holds a JSON line over"):
        docs_of(tmp_path / "c.jsonl.gz")
    # the range that ends before it is read in full
    docs = [d for b in read_unit(str(tmp_path / "c.jsonl"), "jsonl", 0, start, "text",
                                 BadRecords()) for d in b]
    assert docs == [f"doc {i}" for i in range(41)]



def _bytes_held_per_batch(monkeypatch) -> list[int]:
    """The bytes of each column batch the Parquet reader hands on, as it reads them."""
    held = []
    real = document_reader._column_batches

    def spy(column, where, bad):
        held.append(column.nbytes)
        return real(column, where, bad)
    monkeypatch.setattr(document_reader, "_column_batches", spy)
    return held

def test_a_document_over_the_limit_fails_in_each_records_format(tmp_path, small_limits):
    big = "é" * (9 << 10)  # 18 KiB of UTF-8 in 9 K characters: over 16 KiB
    docs = TABLE_DOCS[:35] + [big] + TABLE_DOCS[35:]
    (tmp_path / "c.jsonl").write_bytes(
        b"".join(json.dumps({"text": d}, ensure_ascii=False).encode() + b"\n" for d in docs))
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=30)
    (tmp_path / "c.arrow").write_bytes(_arrow_stream(pa.table({"text": docs})))
    where = {"c.jsonl": "c.jsonl:line 36", "c.parquet": "c.parquet:row group 1:row 5",
             "c.arrow": "c.arrow:row 35"}
    for name, location in where.items():
        with pytest.raises(DataError) as err:
            docs_of(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / location} holds a document over "
                                         "16,384 bytes"), name
        assert "hpctrain.sizes.MAX_DOCUMENT_BYTES); split that document" in str(err.value)


def test_a_repeated_dictionary_value_over_the_limit_fails_before_rows_are_decoded(
        tmp_path, small_limits, monkeypatch):
    """One long value in every row of a dictionary-encoded column of strings: read as a
    dictionary, the value is held once and each row's length is known without decoding
    the rows (4,000 rows of 20 KiB would be 80 MB)."""
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 4000, pa.int32()),
                                            pa.array(["y" * (20 << 10)]))
    pq.write_table(pa.table({"text": column}), tmp_path / "d.parquet", store_schema=False)
    held = _bytes_held_per_batch(monkeypatch)
    with pytest.raises(DataError, match=r"d.parquet:row group 0:row 0 holds a document"):
        prepare([tmp_path / "d.parquet"], tmp_path / "o.h5", show_progress=False)
    assert held and max(held) < 64 << 10


def test_a_large_dictionary_column_read_plainly_counts_rows_as_its_longest_value(
        tmp_path, monkeypatch):
    """Over ``DICTIONARY_READ_BYTES`` a dictionary-encoded column is read plainly: a
    batch then takes as few rows as the longest dictionary value allows."""
    block = 64 << 10
    monkeypatch.setattr(document_reader, "BLOCK_BYTES", block)
    monkeypatch.setattr(document_reader, "DICTIONARY_READ_BYTES", 1000)
    column = pa.DictionaryArray.from_arrays(pa.array([0, 1] * 2000, pa.int32()),
                                            pa.array(["y" * 10_000, "short"]))
    pq.write_table(pa.table({"text": column}), tmp_path / "d.parquet", store_schema=False)
    held = _bytes_held_per_batch(monkeypatch)
    docs = [d for b in read_unit(str(tmp_path / "d.parquet"), "parquet", 0, 1, "text",
                                 BadRecords()) for d in b]
    assert docs == ["y" * 10_000, "short"] * 2000
    assert max(held) < block + 10_000  # 1,024 rows a batch would hold 5 MB


def test_a_dictionary_column_of_text_is_text(tmp_path):
    """A categorical column (pandas writes them, the Arrow schema kept in the file)."""
    column = pa.DictionaryArray.from_arrays(pa.array([1, 0, 1] * 10, pa.int32()),
                                            pa.array(["ab", "c"]))
    pq.write_table(pa.table({"text": column}), tmp_path / "d.parquet")
    s = prepare([tmp_path / "d.parquet"], tmp_path / "o.h5", tokenizer="byte",
                show_progress=False)
    assert (s["tokens"], s["bad_records"]) == (len("\nc\nab\nc") * 10, 0)


def test_a_parquet_page_over_the_limit_fails_before_it_is_decompressed(tmp_path, monkeypatch):
    monkeypatch.setattr(document_reader, "MAX_PAGE_BYTES", 64 << 10)
    docs = [f"{i:03d}" + "q" * 10_000 for i in range(12)]  # each under the document limit
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", use_dictionary=False,
                   compression="zstd", data_page_size=1 << 20)  # one page of 120 KB
    monkeypatch.setattr(document_reader, "_column_batches", None)  # nothing is decoded
    with pytest.raises(DataError) as err:
        prepare([tmp_path / "c.parquet"], tmp_path / "o.h5", show_progress=False)
    assert str(err.value).startswith(f"{tmp_path / 'c.parquet'}:row group 0 holds a page of "
                                     "120,")
    assert "hpctrain.sizes.MAX_PAGE_BYTES" in str(err.value)


@pytest.mark.parametrize("options", [
    {"use_dictionary": False}, {}, {"dictionary_pagesize_limit": 2000},
    {"data_page_version": "2.0", "compression": "zstd"}, {"write_statistics": False}])
def test_page_headers_give_each_pages_size_and_values(tmp_path, options):
    from hpctrain.data.parquet_pages import DICTIONARY_PAGE, chunk_pages

    docs = [f"doc {i} " + "w" * (i % 97) for i in range(5000)]
    pq.write_table(pa.table({"id": list(range(5000)), "text": docs}), tmp_path / "c.parquet",
                   row_group_size=2000, data_page_size=8000, write_batch_size=100, **options)
    md = pq.ParquetFile(tmp_path / "c.parquet").metadata
    with open(tmp_path / "c.parquet", "rb") as f:
        for g in range(md.num_row_groups):
            chunk = md.row_group(g).column(1)
            pages = chunk_pages(f, chunk)
            data = [p for p in pages if p[0] != DICTIONARY_PAGE]
            assert sum(n for _, _, n in data) == md.row_group(g).num_rows
            assert len(pages) >= 2  # a dictionary and its indices, or plain pages of 8 KB
            assert (pages[0][0] == DICTIONARY_PAGE) == chunk.has_dictionary_page
            assert sum(size for _, size, _ in pages) <= chunk.total_uncompressed_size
            assert sum(size for _, size, _ in pages) > 0.9 * chunk.total_uncompressed_size


def test_parquet_batches_hold_about_a_block_of_long_rows(tmp_path, monkeypatch):
    block = 64 << 10
    monkeypatch.setattr(document_reader, "BLOCK_BYTES", block)
    docs = [f"{i:05d}" + "z" * 10_000 for i in range(300)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", use_dictionary=False,
                   row_group_size=300)
    seen = []
    real = document_reader._column_batches

    def spy(column, where, bad):
        seen.append(len(column))
        return real(column, where, bad)
    monkeypatch.setattr(document_reader, "_column_batches", spy)
    batches = list(read_unit(str(tmp_path / "c.parquet"), "parquet", 0, 1, "text", BadRecords()))
    assert [d for b in batches for d in b] == docs
    assert max(seen) <= 7  # 64 KiB of 10 KB rows, not BATCH_ROWS (1,024) of them
    assert max(sum(len(d) for d in b) for b in batches) < block + 10_006


def test_arrow_record_batches_are_handed_on_in_runs_of_about_a_block(tmp_path, monkeypatch):
    block = 64 << 10
    monkeypatch.setattr(document_reader, "BLOCK_BYTES", block)
    docs = [f"{i:05d}" + "z" * 10_000 for i in range(300)]
    path = tmp_path / "c.arrow"
    with pa.ipc.new_stream(str(path), pa.schema([("text", pa.string())])) as w:
        w.write_table(pa.table({"text": docs}), max_chunksize=300)  # one 3 MB record batch
    batches = list(read_unit(str(path), "arrow", 0, 0, "text", BadRecords()))
    assert [d for b in batches for d in b] == docs
    assert max(sum(len(d) for d in b) for b in batches) < block + 10_006


def test_a_text_file_over_the_limit_fails_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(document_reader, "MAX_TEXT_FILE_BYTES", 1000)
    path = tmp_path / "book.txt"
    path.write_text("a" * 1001)
    with pytest.raises(DataError) as err:
        docs_of(path)
    assert str(err.value).startswith(f"{path} holds 1,001 bytes: a text file is one document")
    assert "MAX_TEXT_FILE_BYTES); split it into smaller files" in str(err.value)
    path.write_text("a" * 1000)
    assert docs_of(path) == ["a" * 1000]


def test_the_limits_hold_a_real_document_and_are_named_in_one_place():
    assert MAX_LINE_BYTES >= 2 * MAX_DOCUMENT_BYTES >= 32 * MiB
    assert (document_reader.MAX_DOCUMENT_BYTES, document_reader.MAX_LINE_BYTES) == \
        (MAX_DOCUMENT_BYTES, MAX_LINE_BYTES)


def _run_prepare(tmp_path: Path, path: Path, timeout: int = 120):
    out = tmp_path / "o.h5"
    return subprocess.run([sys.executable, "-m", "hpctrain", "prepare", "--input", str(path),
                           "--output", str(out), "--tokenizer", "byte"],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["zst cut inside its second frame", "gz cut short",
                                  "zst with a corrupt block"])
def test_the_command_exits_2_with_one_line_on_a_broken_stream(tmp_path, case):
    name, data = _broken_inputs()[case]
    path = tmp_path / name
    path.write_bytes(data)
    r = _run_prepare(tmp_path, path)
    assert r.returncode == EXIT_USER_ERROR, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"error: {path} is not a complete")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written


def test_the_command_exits_2_with_one_line_on_a_text_file_over_the_limit(tmp_path):
    path = tmp_path / "book.txt"
    with open(path, "wb") as f:
        f.truncate(MAX_TEXT_FILE_BYTES + 1)  # sparse: refused by its size, never read
    r = _run_prepare(tmp_path, path)
    assert r.returncode == EXIT_USER_ERROR and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {path} holds {MAX_TEXT_FILE_BYTES + 1:,} bytes: a text")
    assert "hpctrain.sizes.MAX_TEXT_FILE_BYTES); split it into smaller files" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["book.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["nul.jsonl.zst", "nul.jsonl.gz", "nul.parquet",
                                  "nul-plain.parquet"])
def test_gigabytes_of_nuls_end_with_exit_2_and_one_line_in_bounded_memory(tmp_path, name):
    """At the default limits: 4 GB of NULs in 130 KB of zstd, 1 GB in 1 MB of gzip, a
    Parquet column of 40 MB values (3 GB decoded) in 2 MB, a Parquet page of 90 MB in
    10 KB of zstd: each is refused at its first line, row or page, and the command's peak
    RSS stays under 512 MiB."""
    path = tmp_path / name
    if name.endswith(".zst"):
        path.write_bytes(_nul_zst(4096 * MiB))
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(b"\0" * (64 * MiB), 1) * 16)
    elif name == "nul-plain.parquet":
        pq.write_table(pa.table({"text": ["\0" * (30 * MiB)] * 3}), path,
                       use_dictionary=False, compression="zstd")
    else:
        column = pa.DictionaryArray.from_arrays(pa.array([0] * 80, pa.int32()),
                                                pa.array(["\0" * (40 * MiB)]))
        pq.write_table(pa.table({"text": column}), path, store_schema=False)  # read as text
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = tmp_path / "o.h5"
    r = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m", "hpctrain",
                        "prepare", "--input", str(path), "--output", str(out),
                        "--tokenizer", "byte"], capture_output=True, text=True, timeout=240)
    rc, peak_kib = map(int, r.stdout.split())
    assert rc == EXIT_USER_ERROR and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {path}:") and "a limit of hpctrain's" in r.stderr
    assert peak_kib < 512 * 1024, f"peak RSS {peak_kib} KiB"
    assert not out.exists()
