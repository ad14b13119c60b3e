"""``prepare`` from records files (JSON lines plain and compressed, Parquet, Arrow, a
dataset directory): the tokens are each document after the separator, in order; byte
ranges and row groups read the same documents wherever the cuts fall; reading streams
with bounded memory; bad records are counted, located, skipped or fatal."""

from __future__ import annotations

import gzip
import json
import random
import sys
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpctrain.cli import main
from hpctrain.data import document_reader
from hpctrain.data.prepare import prepare
from hpctrain.data.document_reader import BadRecords, read_unit
from hpctrain.data.sources import (JSONL, PARQUET, TEXT, expand_inputs, file_format,
                                   plan_units)
from hpctrain.errors import EXIT_USER_ERROR, DataError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

DOCS = [f"doc {i}: " + "wörd " * (i % 11) + ("\nsecond line" if i % 5 == 0 else "")
        for i in range(200)]


def write_records(path: Path, docs=DOCS, field: str = "text") -> Path:
    """``docs`` in the format ``path``'s name says."""
    lines = "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)).encode()
    name = path.name
    if name.endswith((".jsonl", ".json")):
        path.write_bytes(lines)
    elif name.endswith(".gz"):
        path.write_bytes(gzip.compress(lines))
    elif name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(lines))
    elif name.endswith(".parquet"):
        pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path,
                       row_group_size=23)
    elif name.endswith(".arrow"):
        table = pa.table({field: docs})
        with pa.ipc.new_stream(str(path), table.schema) as w:
            w.write_table(table, max_chunksize=30)
    return path


def tokens_of(path: Path) -> np.ndarray:
    """Every token in input order: each source's train part, then its val part
    (``/source_tokens`` says how many of each)."""
    with h5py.File(path, "r") as f:
        train, val, counts = f["train"][:], f["val"][:], f["source_tokens"][:]
    t, v = np.cumsum([0, *counts[:, 0]]), np.cumsum([0, *counts[:, 1]])
    return np.concatenate([np.concatenate([train[t[i]:t[i + 1]], val[v[i]:v[i + 1]]])
                           for i in range(len(counts))])


def expected_bytes(docs) -> np.ndarray:
    """Byte tokens of the documents, each after a newline (the byte tokenizer's separator)."""
    return np.frombuffer("".join("\n" + d for d in docs).encode(), dtype=np.uint8)


FORMATS = ["c.jsonl", "c.json", "c.jsonl.gz", "c.json.zst", "c.parquet", "c.arrow"]


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_gives_every_document_after_the_separator(tmp_path, name):
    path = write_records(tmp_path / name)
    s = prepare([path], tmp_path / "out.h5", tokenizer="byte", show_progress=False)
    assert np.array_equal(tokens_of(tmp_path / "out.h5"), expected_bytes(DOCS))
    assert (s["files"], s["bad_records"]) == (1, 0)


def test_text_field_picks_the_column_and_char_vocabulary_holds_the_newline(tmp_path):
    path = write_records(tmp_path / "c.parquet", docs=["abc", "cab", "bca"] * 20,
                         field="content")
    s = prepare([path], tmp_path / "out.h5", tokenizer="char", text_field="content",
                show_progress=False)
    assert s["vocab_size"] == 4  # "\n" separates the documents: "\n" < "a" < "b" < "c"
    assert tokens_of(tmp_path / "out.h5")[:8].tolist() == [0, 1, 2, 3, 0, 3, 1, 2]


def test_a_dataset_directory_takes_its_records_files_in_order(tmp_path):
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    write_records(data / "train-00001-of-00002.parquet", DOCS[100:])
    write_records(data / "train-00000-of-00002.jsonl.gz", DOCS[:100])
    for other in ("README.md", "dataset_info.json", ".gitattributes", "data/state.json"):
        (tmp_path / "ds" / other).write_text("{}")
    files = expand_inputs([str(tmp_path / "ds")])
    assert [f.name for f in files] == ["train-00000-of-00002.jsonl.gz",
                                       "train-00001-of-00002.parquet"]
    prepare([tmp_path / "ds"], tmp_path / "out.h5", tokenizer="byte", show_progress=False)
    assert np.array_equal(tokens_of(tmp_path / "out.h5"), expected_bytes(DOCS))


def test_a_directory_of_text_files_is_still_every_file(tmp_path):
    (tmp_path / "t").mkdir()
    for name in ("b.txt", "a.md", "notes"):
        (tmp_path / "t" / name).write_text(name)
    assert [f.name for f in expand_inputs([str(tmp_path / "t")])] == ["a.md", "b.txt", "notes"]
    assert [file_format(n) for n in ("x.JSONL", "x.json.gz", "dataset_info.json", "x.txt")] \
        == [JSONL, "jsonl.gz", TEXT, TEXT]


def test_plan_cuts_json_lines_into_ranges_and_parquet_into_row_groups():
    units = plan_units([1000, 50, 300], [JSONL, "jsonl.zst", PARQUET],
                       [[], [], [100, 120, 80]], n_ranks=2, max_unit_bytes=400)
    ranges = [u for u in units if u[0] == 0]
    assert ranges[0][1] == 0 and ranges[-1][2] == 1000 and len(ranges) == 6  # 1350/8 a piece
    assert all(a[2] == b[1] for a, b in zip(ranges, ranges[1:]))  # contiguous, no gap
    assert [u for u in units if u[0] == 1] == [[1, 0, 50, 50]]  # compressed: whole
    assert [u for u in units if u[0] == 2] == [[2, 0, 1, 100], [2, 1, 2, 120], [2, 2, 3, 80]]


def test_byte_ranges_read_every_line_once_wherever_the_cuts_fall(tmp_path):
    path = write_records(tmp_path / "c.jsonl")
    size = path.stat().st_size
    newlines = [i + 1 for i, b in enumerate(path.read_bytes()) if b == 10]
    rng = random.Random(0)
    for cuts in ([0, size], [0, newlines[3], size], [0, newlines[3] - 1, newlines[3] + 1, size],
                 sorted({0, size, *rng.sample(range(1, size), 40)})):
        got = [d for a, b in zip(cuts, cuts[1:])
               for batch in read_unit(str(path), JSONL, a, b, "text", BadRecords())
               for d in batch]
        assert got == DOCS, cuts


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", ["big.jsonl", "big.jsonl.zst"])
def test_a_file_larger_than_the_bound_streams_in_bounded_memory(tmp_path, monkeypatch, name):
    block = 64 << 10
    monkeypatch.setattr(document_reader, "BLOCK_BYTES", block)
    docs = [f"{i} " + "x" * 1000 for i in range(4000)]  # 4 MB: 64 blocks
    path = write_records(tmp_path / name, docs)
    seen = []

    def stream():
        for batch in read_unit(str(path), file_format(path), 0, path.stat().st_size, "text",
                               BadRecords()):
            seen.append(len(batch))
    peak = _peak_bytes(stream)
    assert sum(seen) == len(docs) and len(seen) >= 50
    # zstd hands out a whole block of output at once (up to 128 KiB)
    bound = 8 * block + (zstandard.BLOCKSIZE_MAX if name.endswith(".zst") else 0)
    assert peak < bound, f"peak {peak} bytes while reading {len(docs) * 1000} bytes"


def test_a_whole_prepare_keeps_memory_bounded_whatever_the_input_size(tmp_path, monkeypatch):
    """Read, tokenize, hold until the counts are known, write and verify: none of it
    holds the rank's tokens in memory (they wait in the spill file beside the output)."""
    from hpctrain.data import dataset

    block = 64 << 10
    monkeypatch.setattr(document_reader, "BLOCK_BYTES", block)
    monkeypatch.setattr(dataset, "_VERIFY_READ_BYTES", block)
    path = write_records(tmp_path / "big.jsonl", [f"{i} " + "x" * 1000 for i in range(4000)])
    peak = _peak_bytes(lambda: prepare([path], tmp_path / "out.h5", tokenizer="byte",
                                       show_progress=False))
    token_bytes = h5py.File(tmp_path / "out.h5")["train"].nbytes * 10 // 9
    assert token_bytes > 7 << 20
    assert peak < 64 * block, f"peak {peak} bytes for {token_bytes} bytes of tokens"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "out.h5"]


def test_parquet_is_read_in_record_batches_of_bounded_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(document_reader, "BATCH_ROWS", 16)
    path = write_records(tmp_path / "c.parquet", DOCS)  # row groups of 23 rows
    sizes = [len(b) for b in read_unit(str(path), PARQUET, 0, 9, "text", BadRecords())]
    assert max(sizes) <= 16 and sum(sizes) == len(DOCS)


# ------------------------------------------------------------ bad records

BAD_LINES = {
    "invalid JSON": (b'{"text": "unclosed\n', "invalid JSON"),
    "missing field": (b'{"body": "x"}\n', "no field 'text'"),
    "wrong type": (b'{"text": 42}\n', "field 'text' is a number, not a string"),
    "null": (b'{"text": null}\n', "field 'text' is null, not a string"),
    "not an object": (b'["text"]\n', "a JSON list, not an object"),
    "undecodable bytes": (b'{"text": "caf\xe9"}\n', "undecodable bytes"),
    "lone surrogate": (b'{"text": "caf\\u00e9 \\ud800"}\n', "undecodable text (a lone surrogate"),
}


def _with_bad_line(path: Path, line: bytes, at: int = 5) -> Path:
    good = write_records(path).read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(good[:at] + [line] + good[at:] + [b"\n"]))  # + a blank line
    return path


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_json_line_fails_with_its_count_and_line(tmp_path, case):
    line, why = BAD_LINES[case]
    path = _with_bad_line(tmp_path / "c.jsonl", line)
    with pytest.raises(DataError) as err:
        prepare([path], tmp_path / "out.h5", tokenizer="byte", show_progress=False)
    msg = str(err.value)
    assert msg.startswith("1 bad record(s)") and f"c.jsonl:line 6: {why}" in msg
    assert "--on-bad-record=skip" in msg and not (tmp_path / "out.h5").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["c.jsonl"]  # no temporary left behind
    s = prepare([path], tmp_path / "out.h5", tokenizer="byte", show_progress=False,
                on_bad_record="skip")
    assert s["bad_records"] == 1
    assert np.array_equal(tokens_of(tmp_path / "out.h5"), expected_bytes(DOCS))


def test_bad_records_are_counted_and_the_first_five_located_in_any_range(tmp_path):
    path = write_records(tmp_path / "c.jsonl")
    lines = path.read_bytes().splitlines(keepends=True)
    for k in range(150, 157):  # 7 bad lines, near the end of the file
        lines[k] = b"oops\n"
    path.write_bytes(b"".join(lines))
    bad = BadRecords()
    start = len(b"".join(lines[:100])) - 3  # a range that begins inside line 100
    docs = [d for b in read_unit(str(path), JSONL, start, path.stat().st_size, "text", bad)
            for d in b]
    assert len(docs) == 100 - 7 and bad.count == 7
    assert [w.split(": ")[0] for w in bad.first] == [f"{path}:line {n}"
                                                     for n in range(151, 156)]


def test_a_null_parquet_value_is_located_by_row_group_and_row(tmp_path):
    docs = DOCS[:50]
    pq.write_table(pa.table({"text": docs[:30] + [None] + docs[30:]}), tmp_path / "c.parquet",
                   row_group_size=23)
    with pytest.raises(DataError, match=r"c.parquet:row group 1:row 7: null, not a string"):
        prepare([tmp_path / "c.parquet"], tmp_path / "o.h5", tokenizer="byte",
                show_progress=False)


def test_undecodable_bytes_in_a_binary_column_are_a_bad_record(tmp_path):
    pq.write_table(pa.table({"text": [b"good", b"\xff\xfe", b"also good"]}),
                   tmp_path / "c.parquet")
    s = prepare([tmp_path / "c.parquet"], tmp_path / "o.h5", tokenizer="byte",
                show_progress=False, on_bad_record="skip")
    assert s["bad_records"] == 1 and "row group 0:row 1: undecodable" in s["bad_record_examples"][0]
    assert np.array_equal(tokens_of(tmp_path / "o.h5"), expected_bytes(["good", "also good"]))


@pytest.mark.parametrize("table,message", [
    ({"body": ["x"]}, r"has no column 'text' \(its columns: body\); name the text column"),
    ({"text": [1, 2]}, r"column 'text' of .* holds int64, not text"),
])
def test_a_parquet_file_without_a_text_column_names_its_columns(tmp_path, table, message):
    pq.write_table(pa.table(table), tmp_path / "c.parquet")
    with pytest.raises(DataError, match=message):
        prepare([tmp_path / "c.parquet"], tmp_path / "o.h5", show_progress=False)


def test_the_command_exits_2_on_a_bad_record_and_skips_with_the_option(tmp_path, capsys):
    path = _with_bad_line(tmp_path / "c.jsonl", b"{oops\n")
    args = ["prepare", "--input", str(path), "--tokenizer", "byte", "--output",
            str(tmp_path / "o.h5")]
    assert main(args) == EXIT_USER_ERROR
    assert "c.jsonl:line 6: invalid JSON" in capsys.readouterr().err
    assert main(args + ["--on-bad-record=skip"]) == 0
    assert "skipped 1 bad record(s)" in capsys.readouterr().err


@pytest.mark.parametrize("name,package", [("c.parquet", "pyarrow"), ("c.jsonl.zst", "zstandard")])
def test_a_missing_extra_is_one_line_naming_the_install(tmp_path, monkeypatch, name, package):
    path = write_records(tmp_path / name)
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    with pytest.raises(DataError) as err:
        prepare([path], tmp_path / "o.h5", show_progress=False)
    assert str(err.value) == (f"reading {path} needs the {package} package: pip install "
                              f"'hpctrain[corpora]' (or pip install {package})")


def test_a_spill_is_removed_even_when_its_last_bytes_find_no_room(tmp_path):
    """Another rank's failure ends a rank whose spill still holds buffered bytes on a
    full disk: closing it fails, and it must go all the same (the 4-rank full-disk test)."""
    from hpctrain.data.spill import TokenSpill

    spill = TokenSpill(tmp_path / "out.h5", np.dtype("<u2"))
    spill.append([1, 2, 3])
    buffered = spill._file

    class NoRoom:
        def close(self):
            buffered.close()
            raise OSError(28, "No space left on device")
    spill._file = NoRoom()
    spill.remove()
    assert list(tmp_path.iterdir()) == []
