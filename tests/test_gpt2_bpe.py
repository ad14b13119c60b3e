"""The ``gpt2`` tokenizer on GPT-2's real BPE ranks, offline (the ``hf`` leg).

``make test-hf`` fetches ``r50k_base.tiktoken`` (GPT-2's vocabulary in tiktoken's one-file
form, see tests/fetch_gpt2_bpe.py) and names it in HPCTRAIN_TEST_GPT2_BPE. Each test puts
it into a fresh tiktoken cache under the name tiktoken looks for, so hpctrain's own lookup
(hpctrain/data/tokenizers.py) runs, tiktoken's hash check included, and nothing downloads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpctrain.data.dataset import TokenDataset, read_info
from hpctrain.data.prepare import prepare
from hpctrain.data.tokenizers import _GPT2_URLS, _cache_file, make_tokenizer

pytestmark = pytest.mark.hf

FOX = "The quick brown fox jumps over the lazy dog."
# A text that exercises the pre-tokenizer: code, indentation, digits, contractions,
# accents, CJK, an emoji (bytes split across tokens) and trailing whitespace.
MIXED = ("def f(x):\n    return x ** 2  # it's 42, isn't it?\n\n\n"
         "Grüße aus Köln, naïve café; 東京タワー 🙂!\n\t  tabs\tand  spaces  \n")


@pytest.fixture
def gpt2(tmp_path, monkeypatch):
    """hpctrain's GPT-2 tokenizer, its ranks read from a cache made for this test."""
    src = os.environ.get("HPCTRAIN_TEST_GPT2_BPE")
    if not src:
        pytest.skip("HPCTRAIN_TEST_GPT2_BPE is unset (make test-hf fetches GPT-2's BPE file)")
    pytest.importorskip("tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    dest = _cache_file(_GPT2_URLS["r50k_base"][0])
    dest.parent.mkdir(parents=True)
    shutil.copyfile(src, dest)
    return make_tokenizer("gpt2")


def test_known_gpt2_token_ids(gpt2):
    assert gpt2.encode("Hello world").tolist() == [15496, 995]
    assert gpt2.encode("hello world").tolist() == [31373, 995]  # as in tiktoken's own tests
    assert gpt2.encode(FOX).tolist() == [464, 2068, 7586, 21831, 18045, 625, 262, 16931,
                                         3290, 13]
    assert gpt2.encode("\n").tolist() == [198] and gpt2.encode(" the").tolist() == [262]
    # Text that spells the end-of-text marker stays text: only data preparation may
    # insert the special token, never a document.
    ids = gpt2.encode("hello <|endoftext|>").tolist()
    assert 50256 not in ids and gpt2.decode(ids) == "hello <|endoftext|>"
    assert gpt2.decode(gpt2.encode(MIXED)) == MIXED


def test_same_tokens_as_hugging_face_gpt2_tokenizer(gpt2, tmp_path, monkeypatch):
    """A second implementation from the same ranks: Hugging Face's Rust BPE behind
    ``GPT2TokenizerFast``, with its own copy of GPT-2's pre-tokenizer, agrees token for
    token on a page of real source code and on ``MIXED``."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    _write_vocab_and_merges(os.environ["HPCTRAIN_TEST_GPT2_BPE"], tmp_path)
    hf = transformers.GPT2TokenizerFast.from_pretrained(tmp_path, local_files_only=True)
    text = Path(json.__file__).read_text(encoding="utf-8") + MIXED
    ours = gpt2.encode(text).tolist()
    assert len(ours) > 1000 and hf(text)["input_ids"] == ours
    assert hf("Hello world")["input_ids"] == [15496, 995]


def test_prepare_stores_gpt2_ids(gpt2, tmp_path):
    text = (FOX + "\n" + MIXED) * 20
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    prepare([tmp_path / "t.txt"], tmp_path / "g.h5", tokenizer="gpt2", show_progress=False)
    info = read_info(tmp_path / "g.h5")
    assert info.tokenizer_meta == {"name": "gpt2", "vocab_size": 50257}
    ds = TokenDataset(tmp_path / "g.h5")
    stored = np.concatenate([ds.read(s, [0], info.splits[s].n_tokens)[0]
                             for s in ("train", "val")])
    assert stored.tolist() == gpt2.encode(text).tolist()


def _write_vocab_and_merges(rank_file: str, out) -> None:
    """GPT-2's ``vocab.json`` and ``merges.txt`` rebuilt from tiktoken's rank file.

    The rank of a token is its id, and GPT-2 learned merges in id order: the merge that
    made token ``t`` is the pair that BPE with only the lower-ranked merges leaves when it
    encodes ``t``'s bytes (exactly two pieces, or the file is not a BPE vocabulary).
    """
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(rank_file)
    as_text = _byte_chars()

    def word(b: bytes) -> str:
        return "".join(as_text[x] for x in b)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            pieces = _bpe(token, ranks, below=rank)
            assert len(pieces) == 2, f"token {rank} {token!r} is no merge of two: {pieces}"
            merges.append(" ".join(map(word, pieces)))
    vocab = {word(t): r for t, r in ranks.items()} | {"<|endoftext|>": len(ranks)}
    (out / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n",
                                    encoding="utf-8")


def _bpe(token: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks.get(a + b, below), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs, default=(below, 0))
        if rank >= below:
            return parts
        parts[i:i + 2] = [parts[i] + parts[i + 1]]


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(0x100 + n) for n, b in enumerate(others)}}


def test_records_documents_each_follow_gpt2_end_of_text(gpt2, tmp_path):
    docs = [FOX, MIXED, "hello <|endoftext|> world", "Hello world"]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([tmp_path / "c.jsonl"], tmp_path / "g.h5", tokenizer="gpt2", show_progress=False)
    ds = TokenDataset(tmp_path / "g.h5")
    got = np.concatenate([ds.read(s, [0], ds.splits[s].n_tokens)[0] for s in ("train", "val")])
    want = [t for d in docs for t in [50256, *gpt2.encode(d).tolist()]]
    assert got.tolist() == want  # the marker spelled in a document stays text
