"""Tokenizers, prepare -> read round trip, the sampler, and corrupt-file messages."""

import json

import h5py
import numpy as np
import pytest

from hpctrain.data.corpus import stdlib_files
from hpctrain.data.dataset import TokenDataset
from hpctrain.data.format import token_dtype
from hpctrain.data.prepare import prepare
from hpctrain.data.sampler import (EpochSampler, RandomWindowSampler, all_windows,
                                    shard_range)
from hpctrain.data.split import SPLIT_SEED, shuffled_order, val_tokens_per_file
from hpctrain.data.tokenizers import ByteTokenizer, CharTokenizer, tokenizer_from_meta
from hpctrain.errors import DataError


def test_tokenizers_round_trip():
    text = "Hello, wörld!\n\tdef f(): pass"
    char = CharTokenizer.from_texts([text])
    assert char.decode(char.encode(text)) == text
    assert char.vocab_size == len(set(text))
    assert tokenizer_from_meta(json.loads(json.dumps(char.meta()))).chars == char.chars
    byte = ByteTokenizer()
    assert byte.decode(byte.encode(text)) == text
    with pytest.raises(DataError, match="not in the"):
        char.encode("Z")


def test_prepare_then_read_equals_the_text(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\nwith two lines")  # no trailing newline: one is added
    b.write_text("second file\n" * 50)
    out = tmp_path / "d.h5"
    summary = prepare([tmp_path], out, val_fraction=0.25, show_progress=False)
    a_text, b_text = "first file\nwith two lines\n", "second file\n" * 50
    text = a_text + b_text
    assert summary["tokens"] == len(text) and summary["files"] == 2
    ds = TokenDataset(out)
    n_train = int(len(text) * 0.75)
    assert ds.splits["train"].n_tokens == n_train
    assert ds.splits["train"].dtype == np.uint16
    # The seeded order (data/split.py) puts a.txt first: all its 26 tokens go to val,
    # then the last 131 of b.txt's 600. Each split keeps the input order: train is the
    # head of b.txt, val is a.txt then the tail of b.txt.
    assert val_tokens_per_file([len(a_text), len(b_text)], len(text) - n_train) == [26, 131]
    train, val = b_text[:-131], a_text + b_text[-131:]
    starts = np.array([0, 5, n_train - 11])
    got = ds.read("train", starts, 11)
    for s, row in zip(starts, got):
        assert ds.tokenizer.decode(row) == train[s:s + 11]
    assert ds.tokenizer.decode(ds.read("val", np.array([0]), len(val))[0]) == val
    with h5py.File(out) as f:  # contiguous: a fixed byte offset, as MPI-IO needs
        assert f["train"].chunks is None and f["train"].id.get_offset() is not None
    assert ds.verify() == []


def test_byte_tokenizer_and_wide_vocab_dtype(tmp_path):
    # Every byte but NUL, which makes a file binary (refused as text, test_run_traps.py).
    (tmp_path / "x.txt").write_bytes(bytes(range(1, 256)) * 4)
    ds = TokenDataset(prepare([tmp_path / "x.txt"], tmp_path / "b.h5", tokenizer="byte",
                              show_progress=False)["output"])
    assert ds.vocab_size == 256 and ds.read("train", np.array([0]), 4)[0].tolist() == [1, 2, 3, 4]
    assert token_dtype(70000) == np.uint32


def test_stdlib_corpus_is_deterministic_and_ascii():
    files = stdlib_files(200_000)
    assert files == stdlib_files(200_000) and files
    assert all(f.read_bytes().isascii() for f in files)
    assert sum(f.stat().st_size for f in files) <= 200_000


def test_split_order_is_the_documented_hash_order():
    # io/FORMAT.md documents this order; a change would silently move every dataset's
    # validation split, so it is pinned here.
    assert SPLIT_SEED == 0
    assert shuffled_order(10) == [3, 7, 9, 8, 5, 4, 2, 6, 0, 1]
    assert sorted(shuffled_order(1000)) == list(range(1000))
    assert shuffled_order(10, seed=1) != shuffled_order(10)


def test_split_takes_whole_files_in_seeded_order_then_the_tail_of_one():
    counts = [100] * 100
    val = val_tokens_per_file(counts, 1000)
    chosen = [i for i, v in enumerate(val) if v]
    assert sorted(set(val)) == [0, 100] and chosen == sorted(shuffled_order(100)[:10])
    assert min(chosen) < 50 <= max(chosen)  # from the whole list, not its tail
    assert val_tokens_per_file(counts, 1000, seed=1) != val
    # 1050: ten whole files, then the last 50 tokens of the eleventh in the order
    val = val_tokens_per_file(counts, 1050)
    assert sum(val) == 1050 and val[shuffled_order(100)[10]] == 50
    assert sorted(val).count(50) == 1


def test_split_sizes_are_exact_and_at_most_one_file_is_cut():
    counts = np.random.default_rng(3).integers(0, 5000, 300).tolist()
    counts[7] = 0  # an empty file is never a problem
    for n_val in (0, 1, 12_345, sum(counts) // 2, sum(counts)):
        val = val_tokens_per_file(counts, n_val)
        assert sum(val) == n_val and all(0 <= v <= c for v, c in zip(val, counts))
        assert sum(0 < v < c for v, c in zip(val, counts)) <= 1
    with pytest.raises(ValueError):
        val_tokens_per_file(counts, sum(counts) + 1)


def test_a_single_file_keeps_the_tail_split():
    # nanoGPT's rule for one file (tiny Shakespeare): its last tokens are validation.
    assert val_tokens_per_file([1_115_394], 111_540) == [111_540]


def test_stdlib_validation_split_is_drawn_from_the_whole_corpus(dataset_path):
    """The default corpus is sorted by path; its tail (``encodings/cp*.py`` at full size)
    is not a sample of it. The validation split must come from files all over the list,
    and the file must be exactly the rule's reference layout."""
    files = stdlib_files(300_000)  # tests/helpers.py make_dataset
    texts = [f.read_bytes().decode() for f in files]  # bytes: no newline translation
    texts = [t + "\n" if t and not t.endswith("\n") and i < len(texts) - 1 else t
             for i, t in enumerate(texts)]  # prepare's joining rule
    corpus = "".join(texts)
    ds = TokenDataset(dataset_path)
    n_val = ds.splits["val"].n_tokens
    assert n_val == len(corpus) - int(len(corpus) * 0.9)
    train, val = (ds.tokenizer.decode(ds.read(name, np.array([0]), ds.splits[name].n_tokens)[0])
                  for name in ("train", "val"))
    assert val != corpus[-n_val:]  # the old rule: the last 10% of the joined files
    take = val_tokens_per_file([len(t) for t in texts], n_val)
    in_val = [i for i, v in enumerate(take) if v]
    assert min(in_val) < len(files) // 2 <= max(in_val), in_val  # early and late files
    assert any(0 < v == len(t) for v, t in zip(take, texts))  # some files wholly in val
    # the reference layout: each split is its parts of the files, in input order
    assert val == "".join(t[len(t) - v:] for t, v in zip(texts, take))
    assert train == "".join(t[:len(t) - v] for t, v in zip(texts, take))
    with h5py.File(dataset_path) as f:
        assert json.loads(f.attrs["split"]) == {"rule": "shuffled-files", "seed": SPLIT_SEED,
                                                "val_fraction": 0.1}
        assert f["source_tokens"][()].tolist() == [[len(t) - v, v] for t, v in zip(texts, take)]


@pytest.mark.parametrize("cls", [EpochSampler, RandomWindowSampler])
def test_sampler_depends_on_seed_and_step_only(cls):
    s = cls(10_000, 32, batch_size=8, seed=5)
    g = s.global_starts(3)
    assert np.array_equal(g, cls(10_000, 32, 8, 5).global_starts(3))  # resumable, fresh object
    assert not np.array_equal(g, s.global_starts(4))
    assert not np.array_equal(g, cls(10_000, 32, 8, 6).global_starts(3))
    for world in (1, 2, 4, 8):
        parts = [s.local_starts(3, r, world) for r in range(world)]
        assert np.array_equal(np.concatenate(parts), g)
    for step in range(0, 2000, 97):  # every window fits, also across epochs
        starts = s.global_starts(step)
        assert starts.min() >= 0 and starts.max() + 32 + 1 <= 10_000
    with pytest.raises(ValueError):
        shard_range(8, 0, 3)


def test_epoch_sampler_visits_every_window_once_per_epoch():
    s = EpochSampler(1000, 10, batch_size=7, seed=0)
    assert s.per_epoch == 99
    starts = np.concatenate([s.global_starts(k) for k in range(99 * 2 // 7 + 1)])
    first, second = starts[:99], starts[99:198]
    for epoch in (first, second):
        phase = epoch.min() % 10
        assert sorted(epoch.tolist()) == [phase + 10 * k for k in range(99)]
    assert not np.array_equal(first, second)  # a new permutation each epoch


def test_all_windows_cover_the_split_without_overlap():
    w = all_windows(100, 16)
    assert w.tolist() == [0, 16, 32, 48, 64, 80] and w[-1] + 16 + 1 <= 100


# ---------------------------------------------------------------- bad files

def test_missing_file_says_how_to_create_it(tmp_path):
    with pytest.raises(DataError, match="does not exist; create it with `hpctrain prepare"):
        TokenDataset(tmp_path / "nope.h5")


def test_truncated_file(dataset_path, tmp_path):
    bad = tmp_path / "cut.h5"
    bad.write_bytes(dataset_path.read_bytes()[: dataset_path.stat().st_size // 2])
    with pytest.raises(DataError, match="truncated"):
        TokenDataset(bad)


def test_not_hdf5(tmp_path):
    bad = tmp_path / "text.h5"
    bad.write_text("hello")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        TokenDataset(bad)


def _copy(src, dst):
    dst.write_bytes(src.read_bytes())
    return dst


def test_wrong_magic_and_version(dataset_path, tmp_path):
    bad = _copy(dataset_path, tmp_path / "m.h5")
    with h5py.File(bad, "a") as f:
        f.attrs["magic"] = "something-else"
    with pytest.raises(DataError, match="not an hpctrain token file"):
        TokenDataset(bad)
    bad = _copy(dataset_path, tmp_path / "v.h5")
    with h5py.File(bad, "a") as f:
        f.attrs["format_version"] = 99
    with pytest.raises(DataError, match="format version 99"):
        TokenDataset(bad)


def test_flipped_byte_fails_the_checksum(dataset_path, tmp_path):
    bad = _copy(dataset_path, tmp_path / "c.h5")
    offset = TokenDataset(bad).splits["train"].offset
    raw = bytearray(bad.read_bytes())
    raw[offset + 100] ^= 0xFF
    bad.write_bytes(bytes(raw))
    assert TokenDataset(bad).verify() == ["train block 0"]


def test_data_that_does_not_fit_the_model(dataset_path):
    ds = TokenDataset(dataset_path)
    with pytest.raises(DataError, match=f"--model.vocab_size={ds.vocab_size}"):
        ds.check_fits(16, model_vocab=ds.vocab_size - 1)
    with pytest.raises(DataError, match="lower the block size"):
        ds.check_fits(ds.splits["val"].n_tokens, model_vocab=0)
    ds.check_fits(16, model_vocab=0)
