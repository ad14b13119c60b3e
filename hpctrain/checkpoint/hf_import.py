"""``hpctrain ckpt import --from hf DIR --output CKPT``: a Hugging Face model directory
(GPT-2, Llama, Mixtral or Qwen2-MoE) as an hpctrain checkpoint.

Reads ``config.json`` (through ``hf_config.py``), the safetensors weights (checked
against the shapes it implies through ``hf_names.from_hf``, then made fp32) and
``tokenizer.json`` when there is one; pickle files are refused unopened, since
unpickling runs code from the file. Writes ``weights.save_weights``'s checkpoint, whole
or not at all. ``docs/design/hf-interop.md``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hpctrain.checkpoint.hf_config import CLASSES, SUPPORTED, from_hf_config
from hpctrain.checkpoint.hf_names import IGNORED, from_hf, hf_names
from hpctrain.checkpoint.sharded import CheckpointError
from hpctrain.checkpoint.weights import save_weights
from hpctrain.data.tokenizers import HFTokenizer
from hpctrain.output_paths import check_output_folder
from hpctrain.sizes import MAX_WIDTH, MiB, whole

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
MAX_CONFIG_BYTES = MiB


@dataclass
class Imported:
    path: Path
    model: dict
    """The model record (``GPTConfig.shape()``)."""
    n_params: int
    notes: list[str]


def import_hf(source: str | Path, output: str | Path, *, vocab_multiple: int = 1) -> Imported:
    src, out = Path(source), Path(output)
    if not src.is_dir():
        raise CheckpointError(f"{src} is not a directory; pass a Hugging Face model "
                              f"directory (config.json and {SINGLE})")
    check_output_folder(out, inputs=[src], error=CheckpointError)
    whole(vocab_multiple, "--vocab-multiple", 1, MAX_WIDTH, error=CheckpointError,
          fix="pad to a small multiple such as 64, or 1 for none")
    config = _read_config(src)
    kind = config.get("model_type")
    if kind not in SUPPORTED:  # before reading gigabytes of weights
        raise CheckpointError(f"{src / 'config.json'}: model_type {kind!r} is not one "
                              f"hpctrain imports; it imports {', '.join(SUPPORTED)} "
                              f"({CLASSES})")
    tensors = _read_tensors(src, _weight_files(src))
    if kind == "gpt2" and not any(n.startswith("transformer.") for n in tensors):
        # saved from GPT2Model (OpenAI's published gpt2): the same names, no prefix
        tensors = {(n if n == "lm_head.weight" else f"transformer.{n}"): t
                   for n, t in tensors.items()}
    tensors = {n: t for n, t in tensors.items() if not any(p.fullmatch(n) for p in IGNORED)}
    try:
        model, notes = from_hf_config(config, bias=_has_biases(tensors, kind),
                                      vocab_multiple=vocab_multiple)
    except ValueError as e:
        raise CheckpointError(f"{src / 'config.json'}: {e}; hpctrain imports plain "
                              f"{CLASSES} models") from None
    notes += _dtype_notes(tensors)
    params = _map(src, tensors, model)
    del tensors  # the stored copies (bf16, say): only the fp32 ones are written
    tokenizer = _tokenizer(src, model, notes)
    note = {"from": "hf", "path": str(src.resolve()), "model_type": kind}
    path = save_weights(out, params, model, tokenizer=tokenizer, note=note)
    n = sum(t.numel() for t in params.values())
    return Imported(path, model, n, notes)


def _read_config(src: Path) -> dict:
    path = src / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{src} has no config.json; pass the directory a Hugging Face "
                              "model was saved in (save_pretrained writes config.json)")
    return read_json_object(path, "save the model again with save_pretrained")


def read_json_object(path: Path, fix: str) -> dict:
    """The JSON object in the model config ``path`` (a regular file), checked where it
    enters: at most ``MAX_CONFIG_BYTES``, readable JSON, an object; ``fix`` says what to
    do about a bad one."""
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path} has {path.stat().st_size:,} bytes, too many for a "
                              "model config; is it the right file?")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # ValueError: also not UTF-8
        raise CheckpointError(f"{path} is not readable JSON ({e}); {fix}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object; {fix}")
    return config


def _weight_files(src: Path) -> dict[str, list[str] | None]:
    """Each safetensors file to read, with the tensor names it must hold (None: all)."""
    if (src / SINGLE).is_file():
        return {SINGLE: None}
    if not (src / INDEX).is_file():
        pickles = sorted(p.name for pattern in PICKLES for p in src.glob(pattern))
        if pickles:
            raise CheckpointError(
                f"{src} holds its weights only as pickle ({', '.join(pickles[:3])}), which "
                "hpctrain never opens (unpickling runs code from the file); convert them to "
                "safetensors first, where you trust the file: in Python, transformers' "
                f"AutoModelForCausalLM.from_pretrained('{src}').save_pretrained('NEW_DIR'), "
                "then import NEW_DIR")
        raise CheckpointError(f"{src} has neither {SINGLE} nor {INDEX}; pass a directory "
                              "that save_pretrained wrote in the safetensors format")
    index = src / INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index} is not a safetensors index ({e}); save the model "
                              "again with save_pretrained") from None
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if (not isinstance(file, str) or Path(file).name != file or file.startswith(".")
                or not file.endswith(".safetensors")):
            raise CheckpointError(f"{index} names {file!r} for {name}, not a .safetensors "
                                  "file beside it; save the model again with save_pretrained")
        if not (src / file).is_file():
            raise CheckpointError(f"{index} names {file}, which is missing from {src}; copy "
                                  "every shard of the model there")
        files.setdefault(file, []).append(name)
    return files


def _read_tensors(src: Path, files: dict[str, list[str] | None]) -> dict[str, torch.Tensor]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise CheckpointError("`hpctrain ckpt import` reads weights with the safetensors "
                              "package: `pip install safetensors` (or hpctrain's hf "
                              "extra)") from None
    out = {}
    for file, names in files.items():
        path = src / file
        try:
            with safe_open(path, framework="pt") as f:
                have = set(f.keys())
                missing = [n for n in names or () if n not in have]
                if missing:
                    raise CheckpointError(f"{path} lacks {', '.join(missing[:3])}, which "
                                          f"{INDEX} places there; save the model again")
                for name in names if names is not None else sorted(have):
                    out[name] = f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{path} is not a readable safetensors file "
                                  f"({str(e)[:200]}); copy it again (truncated?)") from None
    return out


OPTIONAL_BIASES = {"gpt2": re.compile(r"transformer\..*\.bias"),
                   "qwen2_moe": re.compile(r"model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias")}
"""Biases a layout always has, which a model without them (hpctrain's ``bias=False``,
``qkv_bias=False``) exports as zeros: GPT-2's on every LayerNorm and projection,
Qwen2-MoE's on q, k and v."""


def _has_biases(tensors: dict[str, torch.Tensor], kind: str) -> bool:
    """Whether any of the layout's optional biases is not exactly zero: all zero is a
    model without them, which imports so."""
    pattern = OPTIONAL_BIASES.get(kind)
    return pattern is not None and any(t.any() for n, t in tensors.items()
                                       if pattern.fullmatch(n))


def _map(src: Path, tensors: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    want = hf_names(model)
    if model["tie_embeddings"]:  # some files carry the tied head too: the embedding's
        tensors = {n: t for n, t in tensors.items() if n != "lm_head.weight"}
    missing, extra = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing:
        raise CheckpointError(f"{src} lacks {', '.join(missing[:3])}"
                              f"{f' and {len(missing) - 3} more' if len(missing) > 3 else ''}"
                              ", which config.json implies; the weights and the config are "
                              "of different models, or shards are missing")
    if extra:
        raise CheckpointError(f"{src} has tensors a plain {model['arch']} model does not: "
                              f"{', '.join(extra[:3])}; hpctrain imports {CLASSES} "
                              "without additions")
    bad = [n for n in want if not tensors[n].is_floating_point()]
    if bad:
        raise CheckpointError(f"{src}: {bad[0]} is {tensors[bad[0]].dtype}, not floating "
                              "point; hpctrain imports unquantized weights")
    try:
        return from_hf(tensors, model)
    except ValueError as e:
        raise CheckpointError(f"{src}: {e}; the weights and config.json are of different "
                              "models") from None


def _dtype_notes(tensors: dict[str, torch.Tensor]) -> list[str]:
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors.values()} - {"float32"})
    return ([f"weights stored as {', '.join(dtypes)} were converted to float32 (exactly)"]
            if dtypes else [])


def _tokenizer(src: Path, model: dict, notes: list[str]) -> dict | None:
    if not (src / "tokenizer.json").is_file():
        notes.append(f"{src} has no tokenizer.json: the checkpoint records no tokenizer "
                     "(prepare data with a tokenizer whose ids are the model's)")
        return None
    tok = HFTokenizer.from_file(src)
    if tok.vocab_size > model["vocab_size"]:
        raise CheckpointError(f"{src / 'tokenizer.json'} has ids up to {tok.vocab_size - 1}, "
                              f"past the model's vocabulary of {model['vocab_size']}; the "
                              "tokenizer is not this model's")
    return tok.meta()
