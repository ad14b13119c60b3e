"""Export a checkpoint's weights: safetensors, and a Hugging Face GPT-2 directory.

safetensors is a plain format (8-byte little-endian header length, a JSON header of
name -> dtype, shape, byte range, then the raw little-endian bytes), written here without
the package. The Hugging Face layout follows ``transformers.GPT2LMHeadModel``: names under
``transformer.``, ``Conv1D`` weights stored as (in, out), i.e. transposed from
``nn.Linear``, a bias on every LayerNorm and projection (zeros when the model has none),
the output head tied to the token embedding, exact-erf GELU (``activation_function:
"gelu"``), LayerNorm epsilon 1e-5, and no dropout.

Both exports drop the embedding's padded rows (``--model.vocab_multiple``): they are no
token, and another program would take every row for one (Hugging Face's
``vocab_size`` must be the tokenizer's, or generation can emit an id nothing decodes).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from hpctrain.files import chmod_as_created

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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in sorted(arrays):
            f.write(arrays[name].astype(arrays[name].dtype.newbyteorder("<")).tobytes())
    chmod_as_created(tmp)  # mkstemp made it 0600
    os.replace(tmp, path)
    return path


def unpadded(params: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """``params`` with the token embedding (and an untied head) cut to the model record's
    ``vocab_size`` rows."""
    return {n: p[:model["vocab_size"]] if n in ("wte.weight", "lm_head.weight") else p
            for n, p in params.items()}


def hf_gpt2_state(params: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """hpctrain parameter names -> ``GPT2LMHeadModel`` names and layouts."""
    params = unpadded(params, model)
    out = {"transformer.wte.weight": params["wte.weight"],
           "transformer.wpe.weight": params["wpe.weight"]}

    def linear(src: str, dst: str, width: int) -> None:
        out[f"{dst}.weight"] = params[f"{src}.weight"].t().contiguous()  # Conv1D: (in, out)
        out[f"{dst}.bias"] = params.get(f"{src}.bias", torch.zeros(width))

    def norm(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = params[f"{src}.weight"]
        out[f"{dst}.bias"] = params.get(f"{src}.bias", torch.zeros_like(params[f"{src}.weight"]))

    C = model["n_embd"]
    for i in range(model["n_layer"]):
        src, dst = f"h.{i}", f"transformer.h.{i}"
        norm(f"{src}.ln_1", f"{dst}.ln_1")
        linear(f"{src}.attn.c_attn", f"{dst}.attn.c_attn", 3 * C)
        linear(f"{src}.attn.c_proj", f"{dst}.attn.c_proj", C)
        norm(f"{src}.ln_2", f"{dst}.ln_2")
        linear(f"{src}.mlp.c_fc", f"{dst}.mlp.c_fc", 4 * C)
        linear(f"{src}.mlp.c_proj", f"{dst}.mlp.c_proj", C)
    norm("ln_f", "transformer.ln_f")
    return {k: v.float() for k, v in out.items()}


def hf_gpt2_config(model: dict) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": model["vocab_size"], "n_positions": model["block_size"],
            "n_embd": model["n_embd"], "n_layer": model["n_layer"], "n_head": model["n_head"],
            "n_inner": 4 * model["n_embd"], "activation_function": "gelu",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "tie_word_embeddings": True, "torch_dtype": "float32"}


def export_hf(out_dir: str | Path, params: dict[str, torch.Tensor], model: dict,
              tokenizer: dict | None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", hf_gpt2_state(params, model),
                      {"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_gpt2_config(model), indent=1))
    if tokenizer is not None:  # hpctrain's byte/char vocabulary: token ids are ours
        (out / "hpctrain_tokenizer.json").write_text(json.dumps(tokenizer, indent=1))
    return out
