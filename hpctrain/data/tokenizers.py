"""Byte, character, GPT-2 BPE and Hugging Face tokenizers. No MPI here.

A tokenizer is described by ``meta()`` (a JSON-able dict stored in the dataset file and
in checkpoints) and rebuilt by ``tokenizer_from_meta``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np

from hpctrain.errors import DataError
from hpctrain.sizes import MAX_VOCAB, MiB, whole


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


MAX_TOKENIZER_JSON_BYTES = 64 * MiB
"""Larger than any real ``tokenizer.json`` (Llama 3's is 9 MB): refused before reading."""


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package (its Rust
    implementation reads the file as data: nothing in it runs as code).

    ``meta()`` embeds the file, zlib-compressed and base64-encoded, with its sha256, so
    that a dataset or a checkpoint decodes on a machine that never saw the file. The
    ``tokenizers`` object is built on first use: training reads only ``vocab_size``, and
    only encoding and decoding need the package.

    Text is encoded without the special tokens a post-processor would add (a BOS per
    call): ``prepare`` encodes whole files, as ``gpt2`` does with ``encode_ordinary``.
    Decoding keeps special tokens as text.
    """

    name = "hf"

    def __init__(self, text: str, vocab_size: int, packed: str | None = None):
        self.text, self.vocab_size = text, vocab_size
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        self._packed = packed
        self._tok = None

    @classmethod
    def from_file(cls, path: str | Path) -> HFTokenizer:
        """``path``: a model directory holding ``tokenizer.json``, or the file itself."""
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(f"{p} does not exist; --tokenizer hf:DIR reads DIR/tokenizer.json, "
                            "a Hugging Face fast tokenizer (a model with only "
                            "tokenizer.model or vocab files: save it once as tokenizer.json "
                            "with transformers' AutoTokenizer.from_pretrained(DIR)"
                            ".save_pretrained(DIR))")
        if p.stat().st_size > MAX_TOKENIZER_JSON_BYTES:
            raise DataError(f"{p} has {p.stat().st_size:,} bytes, more than any tokenizer "
                            f"({MAX_TOKENIZER_JSON_BYTES >> 20} MiB); is it the right file?")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{p} is unreadable ({e}); pass a tokenizer.json") from None
        tok = _build_hf(text, str(p))
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"{p} has an empty vocabulary; pass the model's tokenizer.json")
        # ids may have gaps: the largest decides the vocabulary (and the model's rows)
        size = whole(max(vocab.values()) + 1, f"{p}: the largest token id + 1", 1, MAX_VOCAB,
                     error=DataError, fix="pass the model's own tokenizer.json")
        obj = cls(text, size)
        obj._tok = tok
        return obj

    @classmethod
    def from_meta(cls, meta: dict) -> HFTokenizer:
        try:
            packed = meta["json_zlib"]
            inflate = zlib.decompressobj()  # bounded: a crafted record is no memory bomb
            raw = inflate.decompress(base64.b64decode(packed, validate=True),
                                     MAX_TOKENIZER_JSON_BYTES)
            if inflate.unconsumed_tail or not inflate.eof:
                raise ValueError(f"not one whole file of at most {MAX_TOKENIZER_JSON_BYTES} "
                                 "bytes")
            text = raw.decode()
            vocab = whole(meta["vocab_size"], "its vocab_size", 1, MAX_VOCAB)
        except (KeyError, TypeError, ValueError, binascii.Error, zlib.error) as e:
            raise DataError(f"the recorded Hugging Face tokenizer is damaged ({e}); prepare "
                            "the data again with --tokenizer hf:DIR") from None
        obj = cls(text, vocab, packed)
        if obj.sha256 != meta.get("sha256"):
            raise DataError("the recorded Hugging Face tokenizer fails its sha256 check; "
                            "prepare the data again with --tokenizer hf:DIR")
        return obj

    @property
    def tokenizer(self):
        if self._tok is None:
            self._tok = _build_hf(self.text, "the recorded tokenizer.json")
        return self._tok

    def encode(self, text: str) -> np.ndarray:
        return np.array(self.tokenizer.encode(text, add_special_tokens=False).ids,
                        dtype=np.uint32)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in np.asarray(ids).tolist()],
                                     skip_special_tokens=False)

    def meta(self) -> dict:
        if self._packed is None:  # level 9: the same text gives the same bytes
            self._packed = base64.b64encode(zlib.compress(self.text.encode(), 9)).decode()
        return {"name": self.name, "vocab_size": self.vocab_size, "sha256": self.sha256,
                "json_zlib": self._packed}


class IdsTokenizer:
    """Token ids imported without their tokenizer (``prepare --format``): the vocabulary
    size and end-of-text id are known, the text is not. Training needs nothing more; a
    sample cannot be decoded, which ``decode`` says as a ``DataError`` (so a run that
    samples fails before step 0, not after training)."""

    name = "ids"

    def __init__(self, vocab_size: int, eot_id: int | None, imported_from: str):
        self.vocab_size, self.eot_id, self.imported_from = vocab_size, eot_id, imported_from

    @classmethod
    def from_meta(cls, meta: dict) -> IdsTokenizer:
        vocab = whole(meta.get("vocab_size"), "the recorded vocab_size", 1, MAX_VOCAB,
                      error=DataError, fix="prepare the data again")
        eot = meta.get("eot_id")
        if eot is not None:
            whole(eot, "the recorded eot_id", 0, vocab - 1, error=DataError,
                  fix="prepare the data again")
        return cls(vocab, eot, str(meta.get("imported_from", "")))

    def encode(self, text: str) -> np.ndarray:
        raise DataError(self._why("encoded"))

    def decode(self, ids) -> str:
        raise DataError(self._why("decoded"))

    def _why(self, done: str) -> str:
        return (f"these tokens were imported as ids ({self.imported_from or 'prepare --format'}"
                f", a vocabulary of {self.vocab_size}) without their tokenizer, so text "
                f"cannot be {done} (of converted ids, only GPT-2's, --vocab-size 50257 "
                "--eot-id 50256, record a tokenizer)")

    def meta(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "imported_from": self.imported_from}


def _build_hf(text: str, where: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError("Hugging Face tokenizers (--tokenizer hf:DIR) need the tokenizers "
                        "package: `pip install tokenizers` (or hpctrain's hf extra)") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
        raise DataError(f"{where} is not a tokenizer.json the tokenizers package reads "
                        f"({str(e)[:200]}); pass the model's tokenizer.json") from None
    tok.no_truncation()  # a file may ask for both; whole documents need neither
    tok.no_padding()
    return tok


# End-of-text tokens of common Hugging Face tokenizers, in the order they are looked for.
HF_END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def document_separator(tok) -> list[int]:
    """What ``prepare`` puts before each document of a records file: the tokenizer's
    end-of-text token where it has one (GPT-2's ``<|endoftext|>``, a Hugging Face
    tokenizer's first of ``HF_END_OF_TEXT``), else a newline (char, byte)."""
    if isinstance(tok, GPT2Tokenizer):
        return [tok.encoding.eot_token]
    if isinstance(tok, HFTokenizer):
        for name in HF_END_OF_TEXT:
            found = tok.tokenizer.token_to_id(name)
            if found is not None:
                return [found]
    return [int(i) for i in tok.encode("\n")]


def encode_documents(tok, docs: list[str], separator: list[int]) -> np.ndarray:
    """``separator`` then the tokens of each document, for every document (uint32).
    Each document is encoded on its own, so a document's tokens never depend on where a
    batch or a rank's share begins."""
    if isinstance(tok, GPT2Tokenizer):  # one list for the batch: no array per document
        encode, ids = tok.encoding.encode_ordinary, []
        for doc in docs:
            ids += separator
            ids += encode(doc)
        return np.array(ids, dtype=np.uint32)
    sep = np.array(separator, dtype=np.uint32)
    return np.concatenate([part for doc in docs for part in (sep, tok.encode(doc))]
                          or [np.zeros(0, np.uint32)]).astype(np.uint32, copy=False)


TOKENIZERS = ("byte", "char", "gpt2")
HF_PREFIX = "hf:"


def check_tokenizer_name(name: str) -> None:
    """``prepare --tokenizer``: one of ``TOKENIZERS`` or ``hf:DIR``."""
    if name not in TOKENIZERS and not (name.startswith(HF_PREFIX) and name[len(HF_PREFIX):]):
        raise DataError(f"unknown tokenizer {name!r}; choose one of {', '.join(TOKENIZERS)} "
                        "or hf:DIR (a Hugging Face tokenizer.json in DIR)")


def make_tokenizer(name: str):
    """A tokenizer with a fixed vocabulary (``char`` is built from the text instead)."""
    check_tokenizer_name(name)
    if name == "byte":
        return ByteTokenizer()
    if name == "gpt2":
        tok = GPT2Tokenizer()
        tok.encoding  # fail now, with the message, not halfway through a corpus
        return tok
    if name.startswith(HF_PREFIX):
        return HFTokenizer.from_file(name[len(HF_PREFIX):])
    raise DataError(f"tokenizer {name!r} builds its vocabulary from the text")


def tokenizer_from_meta(meta: dict):
    name = meta.get("name")
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        return CharTokenizer(meta["chars"])
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == HFTokenizer.name:
        return HFTokenizer.from_meta(meta)
    if name == IdsTokenizer.name:
        return IdsTokenizer.from_meta(meta)
    raise DataError(f"unknown tokenizer {name!r}; this hpctrain knows "
                    f"{', '.join(TOKENIZERS)} and {HFTokenizer.name}")


def tokenizer_identity(meta: dict) -> tuple:
    """What makes two tokenizer records the same tokenizer (ids meaning the same text):
    a Hugging Face one by its file's sha256, not by its compressed bytes."""
    if meta.get("name") == HFTokenizer.name:
        return (HFTokenizer.name, meta.get("vocab_size"), meta.get("sha256"))
    return tuple(sorted((k, str(v)) for k, v in meta.items()))
