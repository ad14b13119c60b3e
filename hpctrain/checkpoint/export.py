"""Export a checkpoint's weights: safetensors, and a Hugging Face model directory.

safetensors is written here without the package. The Hugging Face directory holds
``transformers.GPT2LMHeadModel`` (arch gpt) or ``LlamaForCausalLM`` (arch llama) with the
tensor names and layouts of ``hf_names.py`` and the config of ``hf_config.py``;
``hf_import.py`` reads both back through the same two modules. Both exports drop the
embedding's padded rows. ``docs/design/checkpoints.md`` ("Tools") and
``docs/design/hf-interop.md``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from hpctrain.checkpoint.hf_config import to_hf_config
from hpctrain.checkpoint.hf_names import to_hf
from hpctrain.atomic import temporary_directory, temporary_file
from hpctrain.data.tokenizers import HFTokenizer

_DTYPES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64"}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> Path:
    path = Path(path)
    # torch's contiguous(), not np.ascontiguousarray: that one turns a 0-d tensor into (1,)
    arrays = {k: v.detach().cpu().contiguous().numpy() for k, v in tensors.items()}
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in sorted(arrays):
        a = arrays[name]
        header[name] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    with temporary_file(path) as tmp, open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in sorted(arrays):
            f.write(arrays[name].astype(arrays[name].dtype.newbyteorder("<")).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


def unpadded(params: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """``params`` with the token embedding (and an untied head) cut to the model record's
    ``vocab_size`` rows."""
    return {n: p[:model["vocab_size"]] if n in ("wte.weight", "lm_head.weight") else p
            for n, p in params.items()}


def export_hf(out_dir: str | Path, params: dict[str, torch.Tensor], model: dict,
              tokenizer: dict | None) -> Path:
    """A Hugging Face model directory: ``config.json``, ``model.safetensors`` and the
    tokenizer (a Hugging Face one as its own ``tokenizer.json``; hpctrain's byte, char and
    gpt2 as ``hpctrain_tokenizer.json``, whose ids are ours). A new directory appears
    whole or not at all; into an existing one each file is written whole
    (``hpctrain.atomic``)."""
    out = Path(out_dir)
    if out.is_dir():
        _write_hf_files(out, params, model, tokenizer)
        return out
    with temporary_directory(out) as tmp:
        _write_hf_files(tmp, params, model, tokenizer)
    return out


def _write_hf_files(out: Path, params: dict[str, torch.Tensor], model: dict,
                    tokenizer: dict | None) -> None:
    write_safetensors(out / "model.safetensors", to_hf(params, model), {"format": "pt"})
    _write_text(out / "config.json", json.dumps(to_hf_config(model), indent=1))
    if tokenizer is not None and tokenizer.get("name") == HFTokenizer.name:
        _write_text(out / "tokenizer.json", HFTokenizer.from_meta(tokenizer).text)
    elif tokenizer is not None:
        _write_text(out / "hpctrain_tokenizer.json", json.dumps(tokenizer, indent=1))


def _write_text(path: Path, text: str) -> None:
    with temporary_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
