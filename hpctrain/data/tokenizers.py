"""Byte- and character-level tokenizers. No MPI here.

A tokenizer is described by ``meta()`` (a small JSON-able dict stored in the dataset
file and in checkpoints) and rebuilt by ``tokenizer_from_meta``.
"""

from __future__ import annotations

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


TOKENIZERS = ("byte", "char")


def tokenizer_from_meta(meta: dict):
    name = meta.get("name")
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        return CharTokenizer(meta["chars"])
    raise DataError(f"unknown tokenizer {name!r}; this hpctrain knows {', '.join(TOKENIZERS)}")
