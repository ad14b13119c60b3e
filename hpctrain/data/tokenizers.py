"""Byte, character and GPT-2 BPE tokenizers. No MPI here.

A tokenizer is described by ``meta()`` (a small JSON-able dict stored in the dataset
file and in checkpoints) and rebuilt by ``tokenizer_from_meta``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from hpctrain.errors import DataError


class ByteTokenizer:
    """UTF-8 bytes as tokens: a fixed vocabulary of 256, any input works."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")

    def meta(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size}


class CharTokenizer:
    """One token per Unicode character of a fixed vocabulary (sorted, as nanoGPT does)."""

    name = "char"

    def __init__(self, chars: str):
        codes = np.array(sorted({ord(c) for c in chars}), dtype=np.uint32)
        if codes.size == 0:
            raise DataError("cannot build a character vocabulary from empty text")
        self.codes = codes
        self.chars = "".join(map(chr, codes.tolist()))
        self.vocab_size = int(codes.size)

    @classmethod
    def from_texts(cls, texts) -> "CharTokenizer":
        return cls("".join(set().union(*(set(t) for t in texts))))

    def encode(self, text: str) -> np.ndarray:
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        ids = np.searchsorted(self.codes, cps)
        ids = np.minimum(ids, self.vocab_size - 1)
        bad = self.codes[ids] != cps
        if bad.any():
            missing = sorted({chr(c) for c in cps[bad].tolist()})[:10]
            raise DataError(f"characters {missing!r} are not in the {self.vocab_size}-symbol "
                            "vocabulary of this dataset; use only characters from the "
                            "training text (or prepare with --tokenizer byte)")
        return ids.astype(np.uint32)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in np.asarray(ids).tolist())

    def meta(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "chars": self.chars}


# GPT-2's BPE files as tiktoken fetches them; "r50k_base" is the same vocabulary in one file.
_GPT2_URLS = {
    "gpt2": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
             "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"),
    "r50k_base": ("https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",),
}


def tiktoken_cache_dir() -> Path:
    """Where tiktoken looks for its encoding files (its own rule)."""
    for name in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if os.environ.get(name):
            return Path(os.environ[name])
    return Path(tempfile.gettempdir()) / "data-gym-cache"


def _cache_file(url: str) -> Path:
    return tiktoken_cache_dir() / hashlib.sha1(url.encode()).hexdigest()


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 tokens) through ``tiktoken``, from local files only.

    Compute nodes have no internet, and tiktoken downloads its encoding file on first
    use; so the file must already be in tiktoken's cache, and otherwise the error says
    how to put it there. The encoding is loaded on first use: training on a prepared
    GPT-2 dataset needs neither tiktoken nor the file, only sampling text does.
    """

    name = "gpt2"
    vocab_size = 50257

    def __init__(self):
        self._enc = None

    @property
    def encoding(self):
        if self._enc is None:
            self._enc = _load_gpt2()
        return self._enc

    def encode(self, text: str) -> np.ndarray:
        return np.array(self.encoding.encode_ordinary(text), dtype=np.uint32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in np.asarray(ids).tolist()])

    def meta(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size}


def _load_gpt2():
    try:
        import tiktoken
    except ImportError:
        raise DataError("--tokenizer gpt2 needs the tiktoken package: `pip install "
                        "tiktoken`, then its GPT-2 encoding file in tiktoken's cache "
                        "(hpctrain never downloads; see io/README.md, Tokenizers)") from None
    for encoding, urls in _GPT2_URLS.items():
        if all(_cache_file(u).is_file() for u in urls):
            return tiktoken.get_encoding(encoding)
    cache = tiktoken_cache_dir()
    url = _GPT2_URLS["r50k_base"][0]
    raise DataError(
        f"GPT-2's BPE file is not in tiktoken's cache ({cache}), and hpctrain never "
        "downloads (compute nodes have no internet). On a machine with internet run "
        "`TIKTOKEN_CACHE_DIR=gpt2-cache python -c \"import tiktoken; "
        "tiktoken.get_encoding('gpt2')\"`, copy the gpt2-cache directory here and set "
        "TIKTOKEN_CACHE_DIR to it; or download "
        f"{url} and save it as {_cache_file(url)}")


TOKENIZERS = ("byte", "char", "gpt2")


def make_tokenizer(name: str):
    """A tokenizer with a fixed vocabulary (``char`` is built from the text instead)."""
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        tok = GPT2Tokenizer()
        tok.encoding  # fail now, with the message, not halfway through a corpus
        return tok
    raise DataError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)}")


def tokenizer_from_meta(meta: dict):
    name = meta.get("name")
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        return CharTokenizer(meta["chars"])
    if name == "gpt2":
        return GPT2Tokenizer()
    raise DataError(f"unknown tokenizer {name!r}; this hpctrain knows {', '.join(TOKENIZERS)}")
