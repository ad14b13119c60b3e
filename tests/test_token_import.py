"""``prepare --format nanogpt-bin|megatron`` on one process: the written tokens are the
source's, split at document starts (or by the train/val files), the tokenizer record
decodes GPT-2 ids and refuses to decode others, and every bad input is one line, exit 2,
nothing on disk changed. The fixtures are written here from the formats' descriptions
(``hpctrain/data/megatron_index.py``), without nanoGPT or Megatron."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.cli.dispatch import main
from hpctrain.cli.prepare import TOKEN_FORMATS
from hpctrain.data import token_import
from hpctrain.data.dataset import BaseReader, read_info
from hpctrain.data.megatron_index import MAGIC, read_megatron_index
from hpctrain.data.tokenizers import tokenizer_from_meta
from hpctrain.errors import DataError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

EOT = 50256


def gpt2_documents(n_docs: int, seed: int = 0, high: int = EOT) -> list[np.ndarray]:
    """Documents of GPT-2 ids, each ending in end-of-text as nanoGPT writes them."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, high, rng.integers(3, 120)), EOT) for _ in range(n_docs)]


def write_nanogpt(path: Path, tokens) -> np.ndarray:
    tokens = np.asarray(tokens).astype("<u2")
    tokens.tofile(path)
    return tokens


def write_megatron(prefix: Path, docs: list[list[np.ndarray]], code: int = 4,
                   dtype: str = "<i4", *, pointers=None, doc_idx=None,
                   extra: bytes = b"") -> np.ndarray:
    """A Megatron-LM MMapIndexedDataset pair: each document a list of sequences."""
    seqs = [s for d in docs for s in d]
    sizes = np.array([len(s) for s in seqs], "<i4")
    itemsize = np.dtype(dtype).itemsize
    if pointers is None:
        pointers = np.concatenate(([0], np.cumsum(sizes[:-1]))).astype("<i8") * itemsize
    if doc_idx is None:
        doc_idx = np.concatenate(([0], np.cumsum([len(d) for d in docs])))
    tokens = np.concatenate(seqs).astype(dtype)
    tokens.tofile(f"{prefix}.bin")
    doc_idx = np.asarray(doc_idx, "<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, code, len(seqs), len(doc_idx)))
        f.write(sizes.tobytes() + np.asarray(pointers, "<i8").tobytes() + doc_idx.tobytes()
                + extra)
    return tokens


def megatron_docs(n_docs: int, high: int, seed: int = 1) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, rng.integers(1, 60)) for _ in range(rng.integers(1, 4))]
            for _ in range(n_docs)]


def reference_val_ranges(starts: list[int], n: int, val_fraction: float,
                         stripes: int = token_import.STRIPES) -> list[list[int]]:
    """The documented rule (io/README.md) from the list of document starts, each nearest
    start found by looking at every one."""
    def nearest(target, low, high):
        near = [s for s in starts if low <= s <= high]
        return min(near, key=lambda s: (abs(s - target), s)) if near else None
    n_val, ranges, low = n - int(n * (1 - val_fraction)), [], 2
    for i in range(1, stripes + 1):
        share = n_val * i // stripes - n_val * (i - 1) // stripes
        first = nearest(n * i // stripes - share, low, n - 2)
        if first is None:
            break
        low = n if i == stripes else nearest(n * i // stripes, first, n - 2)
        ranges += [[first, low - first]] if low > first else []
    return ranges


def check_striped_split(src: np.ndarray, train: np.ndarray, val: np.ndarray,
                        starts: list[int], val_fraction: float) -> None:
    """``val`` is the reference ranges of ``src``, ``train`` the rest, both whole
    documents; about ``val_fraction`` of the tokens, from all along the input."""
    ranges = reference_val_ranges(starts, src.size, val_fraction)
    assert np.array_equal(val, np.concatenate([src[a:a + c] for a, c in ranges]))
    keep = np.ones(src.size, bool)
    for a, c in ranges:
        keep[a:a + c] = False
        assert a in starts and (a + c in starts or a + c == src.size)
    assert np.array_equal(train, src[keep])
    longest = max(np.diff(starts + [src.size]))
    assert abs(val.size - val_fraction * src.size) <= 2 * token_import.STRIPES * longest
    assert len({a * token_import.STRIPES // src.size for a, _ in ranges}) >= 12  # all along


def read_splits(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    assert not BaseReader(read_info(path)).verify(0, 1)  # every block's CRC-32 holds
    with h5py.File(path) as f:
        return f["train"][:], f["val"][:], dict(f.attrs)


def test_the_cli_formats_are_the_importers():
    assert TOKEN_FORMATS == token_import.FORMATS


def test_a_nanogpt_bin_converts_to_its_tokens_with_whole_documents_in_each_split(tmp_path, capsys):
    src = write_nanogpt(tmp_path / "owt.bin", np.concatenate(gpt2_documents(1000)))
    out = tmp_path / "owt.h5"
    assert main(["prepare", "--format", "nanogpt-bin", "--input", str(tmp_path / "owt.bin"),
                 "--output", str(out)]) == 0
    assert "converted (nanogpt-bin)" in capsys.readouterr().out
    train, val, attrs = read_splits(out)
    assert train.dtype == np.dtype("<u2")
    starts = [0] + (np.flatnonzero(src[:-1] == EOT) + 1).tolist()
    check_striped_split(src, train, val, starts, 0.1)
    assert '"striped-documents"' in attrs["split"]
    assert tokenizer_from_meta(
        json.loads(attrs["tokenizer"])).name == "gpt2"  # samples decode


def test_train_and_val_files_are_the_splits_in_either_order(tmp_path):
    train = write_nanogpt(tmp_path / "train.bin", np.concatenate(gpt2_documents(30, 1)))
    val = write_nanogpt(tmp_path / "val.bin", np.concatenate(gpt2_documents(5, 2)))
    out = tmp_path / "d.h5"
    assert main(["prepare", "--format", "nanogpt-bin", "--input", str(tmp_path / "val.bin"),
                 str(tmp_path / "train.bin"), "--output", str(out)]) == 0
    got_train, got_val, attrs = read_splits(out)
    assert np.array_equal(got_train, train) and np.array_equal(got_val, val)
    assert '"train-val-files"' in attrs["split"]


def test_megatron_converts_whole_documents_and_records_the_ids(tmp_path):
    docs = megatron_docs(400, 100_000)
    src = write_megatron(tmp_path / "web_text_document", docs)
    out = tmp_path / "web.h5"
    assert main(["prepare", "--format", "megatron", "--input",
                 str(tmp_path / "web_text_document.idx"), "--output", str(out),
                 "--vocab-size", "100000", "--eot-id", "99999", "--val-fraction", "0.2"]) == 0
    train, val, attrs = read_splits(out)
    assert train.dtype == np.dtype("<u4")  # above 65,536 ids
    starts = np.cumsum([0] + [sum(len(s) for s in d) for d in docs])[:-1].tolist()
    check_striped_split(src, train, val, starts, 0.2)
    meta = json.loads(attrs["tokenizer"])
    assert meta == {"name": "ids", "vocab_size": 100000, "eot_id": 99999,
                    "imported_from": "megatron"}


def test_the_megatron_cut_is_the_document_start_nearest_the_target(tmp_path):
    """Against every target: the nearest start in [2, n - 2], the earlier on a tie."""
    docs = [[np.arange(k)] for k in (1, 4, 4, 2, 7, 1, 3, 5)]
    write_megatron(tmp_path / "m", docs)
    index = read_megatron_index(str(tmp_path / "m"))
    n = index.n_tokens
    starts = [s for s in np.cumsum([0] + [len(d[0]) for d in docs]).tolist() if 2 <= s <= n - 2]
    for target in range(-1, n + 2):
        best = min(starts, key=lambda s: (abs(s - target), s))
        assert index.nearest_document_start(target, 2, n - 2) == best, target


def test_megatron_gpt2_ids_record_the_gpt2_tokenizer(tmp_path):
    write_megatron(tmp_path / "g", megatron_docs(20, EOT), code=8, dtype="<u2")
    out = tmp_path / "g.h5"
    assert main(["prepare", "--format", "megatron", "--input", str(tmp_path / "g"),
                 "--output", str(out), "--vocab-size", "50257"]) == 0
    assert read_splits(out)[2]["tokenizer"] == '{"name": "gpt2", "vocab_size": 50257}'


def test_chunked_conversion_writes_the_same_bytes(tmp_path, monkeypatch):
    """Many small chunks (rounds, checksum pieces) give the file one chunk gives."""
    write_megatron(tmp_path / "m", megatron_docs(60, 70_000))
    kw = dict(fmt="megatron", vocab_size=70_000)
    token_import.import_tokens([str(tmp_path / "m")], tmp_path / "one.h5", **kw)
    monkeypatch.setattr(token_import, "CHUNK_BYTES", 36)
    token_import.import_tokens([str(tmp_path / "m")], tmp_path / "many.h5", **kw)
    assert (tmp_path / "one.h5").read_bytes() == (tmp_path / "many.h5").read_bytes()


def test_a_split_over_two_checksum_blocks_converts_in_chunks(tmp_path, monkeypatch):
    """34M tokens: /train spans two 64 MiB checksum blocks, written in 16 MiB chunks, so a
    chunk's checksum pieces must land in the block of their place in the array."""
    ids = np.resize(np.concatenate(gpt2_documents(200)).astype("<u2"), 34_000_000)
    write_nanogpt(tmp_path / "big.bin", ids)
    monkeypatch.setattr(token_import, "CHUNK_BYTES", 16 * 2**20)
    token_import.import_tokens([str(tmp_path / "big.bin")], tmp_path / "big.h5",
                               fmt="nanogpt-bin", val_fraction=1e-6)
    train, val, _ = read_splits(tmp_path / "big.h5")  # verifies both blocks' CRC-32
    assert len(train) * 2 > 64 * 2**20 and np.array_equal(np.concatenate([train, val]), ids)


@pytest.mark.parametrize("scan", [3, 7, 1 << 20])
def test_the_nanogpt_cut_is_the_document_start_nearest_the_target(tmp_path, monkeypatch,
                                                                  scan):
    """Against every target and a few bounds, read in rings of ``scan`` tokens: the
    nearest start (a token after an end-of-text) in the bounds, the earlier on a tie;
    None without one."""
    monkeypatch.setattr(token_import, "SCAN_TOKENS", scan)
    ids = np.ones(90, "<u2")
    ids[[0, 5, 9, 13, 40, 41, 88]] = EOT
    write_nanogpt(tmp_path / "a.bin", ids)
    n = ids.size
    starts = [int(p) + 1 for p in np.flatnonzero(ids == EOT)]
    for low, high in ((2, n - 2), (10, 41), (15, 39), (0, n)):
        near = [s for s in starts if low <= s <= high]
        for target in range(-1, n + 2):
            best = min(near, key=lambda s: (abs(s - target), s)) if near else None
            assert token_import._nearest_eot_boundary(str(tmp_path / "a.bin"), n, EOT,
                                                      target, low, high) == best, target
    write_nanogpt(tmp_path / "none.bin", np.ones(50))
    assert token_import._nearest_eot_boundary(str(tmp_path / "none.bin"), 50, EOT, 45,
                                              2, 48) is None


def test_imported_ids_open_but_a_sample_fails_before_the_first_step(tmp_path):
    rng = np.random.default_rng(3)
    write_nanogpt(tmp_path / "train.bin", rng.integers(0, 500, 4096))
    write_nanogpt(tmp_path / "val.bin", rng.integers(0, 500, 1024))
    data = tmp_path / "ids.h5"
    token_import.import_tokens([str(tmp_path / "train.bin"), str(tmp_path / "val.bin")],
                               data, fmt="nanogpt-bin", vocab_size=500)
    cfg = tiny_config(data, tmp_path / "run", **{"train.sample_tokens": 5})
    with pytest.raises(DataError, match=r"sample_tokens.*imported as ids.*cannot be decoded"
                                        r".*--train.sample_tokens=0"):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert BaseReader(read_info(data)).vocab_size == 500  # it opens to train without one


# ------------------------------------------------------------------------- bad input

def _nanogpt(tmp):
    write_nanogpt(tmp / "a.bin", np.concatenate(gpt2_documents(50)))
    return ["--format", "nanogpt-bin", "--input", str(tmp / "a.bin")]


def _megatron(tmp, **kw):
    write_megatron(tmp / "m", megatron_docs(20, 1000), **kw)
    return ["--format", "megatron", "--input", str(tmp / "m"), "--vocab-size", "1000"]


def _idx_bytes(tmp, edit):
    args = _megatron(tmp)
    idx = tmp / "m.idx"
    idx.write_bytes(edit(idx.read_bytes()))
    return args


def _nano_file(tmp, data, name="a.bin"):
    """``data`` (bytes, or ids) as the file ``name``, given to --format nanogpt-bin."""
    if isinstance(data, bytes):
        (tmp / name).write_bytes(data)
    else:
        write_nanogpt(tmp / name, data)
    return ["--format", "nanogpt-bin", "--input", str(tmp / name)]


def _bin_cut(tmp):
    args = _megatron(tmp)
    (tmp / "m.bin").write_bytes((tmp / "m.bin").read_bytes()[:-4])
    return args


N_SEQS = sum(len(d) for d in megatron_docs(20, 1000))
BAD = {
    "text_file": (lambda t: _nano_file(t, b"odd text\n"),
                  r"a.bin has 9 bytes, not a whole number of uint16 tokens.*text"),
    "id_past_vocab": (lambda t: _nano_file(t, [7, 1, 7, 60001, 2, 7])
                      + ["--vocab-size", "60000", "--eot-id", "7"],
                      r"a.bin: token 3 \(byte 6\) is 60001, not an id of a vocabulary of "
                      r"60000; pass the tokenizer's --vocab-size"),
    "tokenizer_too": (lambda t: _nanogpt(t) + ["--tokenizer", "gpt2"],
                      r"nothing for --tokenizer to do; drop it"),
    "vocab_without_format": (lambda t: ["--input", str(t), "--vocab-size", "5"],
                             r"--vocab-size describes tokens converted with --format"),
    "format_with_corpus": (lambda t: ["--format", "megatron", "--corpus", "stdlib"],
                           r"converts the files given with --input"),
    "output_is_input": (lambda t: _nanogpt(t) + ["--output", str(t / "a.bin"), "--overwrite"],
                        r"is one of the inputs"),
    "eot_past_vocab": (lambda t: _nanogpt(t) + ["--vocab-size", "100", "--eot-id", "100"],
                       r"--eot-id is 100, not a whole number in \[0, 99\]"),
    "one_token": (lambda t: _nano_file(t, [EOT]), r"a.bin has 1 token\(s\): too few"),
    "no_eot_in_file": (lambda t: _nano_file(t, np.arange(5000) % 50000),
                       r"no end-of-text id 50256 to split train and val at"),
    "two_other_names": (lambda t: _nanogpt(t) + _nano_file(t, [1, 2, 3], "b.bin")[-1:],
                        r"named train.bin and val.bin, not a.bin, b.bin"),
    "hdf5_given": (lambda t: _nano_file(t, b"\x89HDF\r\n\x1a\n" + bytes(8)),
                   r"is an HDF5 file"),
    "llmc_shard": (lambda t: _nano_file(t, struct.pack("<3i", 20240520, 1, 0)),
                   r"llm.c's shard header"),
    "megatron_no_vocab": (lambda t: _megatron(t)[:-2], r"records no vocabulary size"),
    "megatron_empty_idx": (lambda t: _idx_bytes(t, lambda b: b""),
                           r"m.idx has 0 bytes, fewer than an index header"),
    "megatron_missing": (lambda t: ["--format", "megatron", "--input", str(t / "none"),
                                    "--vocab-size", "9"], r"none.idx does not exist"),
    "megatron_magic": (lambda t: _idx_bytes(t, lambda b: b"XXIDIDX\x00\x00" + b[9:]),
                       r"does not start with Megatron's magic"),
    "megatron_float": (lambda t: _megatron(t, code=7, dtype="<f4"), r"dtype code 7 is floats"),
    "megatron_truncated_idx": (lambda t: _idx_bytes(t, lambda b: b[:-8]),
                               r"its header declares .*truncated or damaged"),
    "megatron_multimodal": (lambda t: _megatron(t, extra=bytes(N_SEQS)), r"multimodal index"),
    "megatron_short_bin": (_bin_cut, r"m.bin has .* the pair does not match"),
    "megatron_pointers": (lambda t: _megatron(t, pointers=np.zeros(N_SEQS, np.int64)),
                          r"sequence 1 starts at byte 0 of the .bin, not at"),
    "megatron_doc_idx": (lambda t: _megatron(t, doc_idx=[0, 3]),
                         r"document indices run from 0 to 3, not from 0 to the"),
    "megatron_id_past_vocab": (lambda t: _megatron(t)[:-1] + ["10"],
                               r"m.bin: token \d+ \(byte \d+\) is \d+, not an id of a "
                               r"vocabulary of 10"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, tmp_path, capsys):
    make, message = BAD[case]
    argv = make(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["prepare", *argv, "--output", str(tmp_path / "out.h5")]
                if "--output" not in argv else ["prepare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(message, err), err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_an_existing_output_is_kept(tmp_path, capsys):
    argv = _nanogpt(tmp_path)
    (tmp_path / "out.h5").write_bytes(b"earlier")
    assert main(["prepare", *argv, "--output", str(tmp_path / "out.h5")]) == 2
    assert "exists; add --overwrite" in capsys.readouterr().err
    assert (tmp_path / "out.h5").read_bytes() == b"earlier"


@pytest.mark.slow
def test_the_command_under_mpiexec_writes_what_one_process_writes(tmp_path):
    """``mpiexec -n 2 hpctrain prepare --format ...``: the one-process bytes; an id past
    the vocabulary is one line from the job, exit 2, nothing written."""
    from tests.helpers import hpctrain_cmd, mpiexec, run

    src = write_nanogpt(tmp_path / "c.bin", np.concatenate(gpt2_documents(500)))
    args = ("prepare", "--format", "nanogpt-bin", "--input", str(tmp_path / "c.bin"))
    p = run(mpiexec(2, *hpctrain_cmd(*args, "--output", str(tmp_path / "two.h5"))))
    assert p.returncode == 0 and "2 rank(s)" in p.stdout, p.stderr
    p = run(hpctrain_cmd(*args, "--output", str(tmp_path / "one.h5")))
    assert p.returncode == 0 and "1 rank(s)" in p.stdout, p.stderr
    assert (tmp_path / "one.h5").read_bytes() == (tmp_path / "two.h5").read_bytes()
    starts = [0] + (np.flatnonzero(src[:-1] == EOT) + 1).tolist()
    check_striped_split(src, *read_splits(tmp_path / "two.h5")[:2], starts, 0.1)
    p = run(mpiexec(2, *hpctrain_cmd(*args, "--vocab-size", "1000", "--eot-id", "0",
                                     "--output", str(tmp_path / "bad.h5"))))
    assert p.returncode == 2 and not (tmp_path / "bad.h5").exists()
    errors = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "not an id of a vocabulary of 1000" in errors[0], p.stderr
