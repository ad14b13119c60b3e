"""``hpctrain prepare``: text files -> one HDF5 token file (see ``format.py``).

The files are read in the order given (directories and globs expand to sorted lists),
joined with a newline where a file does not end in one, tokenized, and split: the last
``val_fraction`` of the tokens is the validation split (nanoGPT's split for Shakespeare).
"""

from __future__ import annotations

import glob
from pathlib import Path

import numpy as np

from hpctrain.data.format import write_token_file
from hpctrain.data.tokenizers import TOKENIZERS, ByteTokenizer, CharTokenizer
from hpctrain.errors import DataError
from hpctrain.progress import Progress


def expand_inputs(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(s.startswith(".") for s in p.parts))
        elif any(ch in item for ch in "*?["):
            found = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
        elif path.is_file():
            found = [path]
        else:
            raise DataError(f"input {item} does not exist; give text files, directories or globs")
        if not found:
            raise DataError(f"input {item} matched no files")
        files.extend(found)
    return files


def _read_all(files: list[Path], as_text: bool, progress: Progress) -> list:
    parts = []
    for path in files:
        raw = path.read_bytes()
        if raw and not raw.endswith(b"\n") and path is not files[-1]:
            raw += b"\n"
        if as_text:
            try:
                parts.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                                "use --tokenizer byte for arbitrary bytes") from None
        else:
            parts.append(raw)
        progress.update(1, path.name[:30])
    return parts


def prepare(inputs: list[str] | list[Path], output: str | Path, *, tokenizer: str = "char",
            val_fraction: float = 0.1, show_progress: bool = True) -> dict:
    """Tokenize ``inputs`` into ``output``; return a summary dict."""
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be between 0 and 1, not {val_fraction}")
    files = expand_inputs([str(p) for p in inputs])
    progress = Progress(len(files), "read", enabled=show_progress)
    parts = _read_all(files, as_text=tokenizer == "char", progress=progress)
    progress.close()
    if tokenizer == "char":
        text = "".join(parts)
        tok = CharTokenizer.from_texts([text]) if text else None
        tokens = tok.encode(text) if tok else np.zeros(0, np.uint32)
    else:
        tok = ByteTokenizer()
        tokens = tok.encode(b"".join(parts))
    n = int(tokens.size)
    n_train = int(n * (1.0 - val_fraction))
    if n_train < 2 or n - n_train < 2:
        raise DataError(f"the input has only {n} tokens: too few for a train and a validation "
                        "split; give more text or change --val-fraction")
    splits = {"train": tokens[:n_train], "val": tokens[n_train:]}
    write_token_file(output, splits, tok.meta(), sources=[str(p) for p in files])
    return {"output": str(output), "files": len(files), "tokens": n, "train_tokens": n_train,
            "val_tokens": n - n_train, "vocab_size": tok.vocab_size, "tokenizer": tok.name}
