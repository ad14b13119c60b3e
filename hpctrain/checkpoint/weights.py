"""A model's weights alone: read them from any checkpoint, write a checkpoint from them.

``load_weights`` takes a run's out_dir, its ``final.h5`` or a sharded checkpoint of any
layout and returns the parameters with the model and tokenizer records (``hpctrain
sample``, ``--train.init_from``, the export). ``save_weights`` writes the sharded
checkpoint that ``hpctrain ckpt import`` makes: world size 1, replicated layout, step 0,
Adam's step 0 and both moments zero. That is exactly the state a fresh AdamW starts
from, so ``--train.resume`` of it starts a new run as ``--train.init_from`` does, and the
format needs no weights-only variant. The zero moments are HDF5 datasets that are never
written (``sharded.Zeros``): they read as zeros and take no disk space, so importing an
8B model writes its 32 GB of fp32 weights, not 96 GB.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import torch

from hpctrain.atomic import temporary_directory
from hpctrain.checkpoint.format import FORMAT, VERSION, shard_name
from hpctrain.checkpoint.sharded import (KEYS, CheckpointError, Zeros, read_full_state,
                                         read_manifest, write_shard, write_synced)
from hpctrain.checkpoint.single_file import load_single_file
from hpctrain.config import Config, ModelConfig
from hpctrain.model.shape import SHAPE_KEYS


def load_weights(path: str | Path, keys: tuple[str, ...] = ("param",)):
    """Parameters, model record and tokenizer record of a run's out_dir, a ``final.h5``
    or a sharded checkpoint: ``(params by name, model dict, tokenizer meta)``."""
    p = Path(path)
    if p.is_file() or (p / "final.h5").is_file():
        ckpt = load_single_file(p)
        params = {k: torch.from_numpy(v) for k, v in ckpt.model.items()}
        model = ckpt.config.get("model") if isinstance(ckpt.config, dict) else None
        if not isinstance(model, dict) or "wte.weight" not in params:
            raise CheckpointError(f"{p} records no model shape or no embedding: it was not "
                                  "written by `hpctrain train` or is damaged")
        model = dict(model)
        # model.vocab_size=0 took the vocabulary from the data: the tokenizer's size, or
        # (a file without one) the embedding's rows, which a padded model has more of
        vocab = ckpt.tokenizer.get("vocab_size") if isinstance(ckpt.tokenizer, dict) else None
        model["vocab_size"] = (model.get("vocab_size") or vocab
                               or params["wte.weight"].shape[0])
        return params, model, ckpt.tokenizer
    if (p / "config.json").is_file() and not (p / "manifest.json").is_file():
        raise CheckpointError(f"{p} looks like a Hugging Face model directory, not an "
                              "hpctrain checkpoint; import it first: hpctrain ckpt import "
                              f"--from hf {p} --output CHECKPOINT_DIR")
    m = read_manifest(p)
    params = {n: s["param"] for n, s in read_full_state(m, keys).items()}
    return params, m.data["model"], m.data.get("tokenizer")


def model_options(model: dict, keys=None) -> list[str]:
    """The ``--model.KEY=VALUE`` options of a run whose model is the one ``model``
    records (``keys``: only those; default every shape key but ``vocab_multiple``, which is
    each run's own choice)."""
    keys = [k for k in SHAPE_KEYS if k != "vocab_multiple"] if keys is None else keys
    return [shlex.quote(f"--model.{k}={_option_value(model[k])}") for k in keys]


def _option_value(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def run_config(model: dict) -> dict:
    """The manifest's ``config`` for a checkpoint made from weights: every default, the
    model section saying what the weights are."""
    fields = set(ModelConfig.__dataclass_fields__)
    return Config(model=ModelConfig(**{k: v for k, v in model.items() if k in fields})
                  ).to_dict()


def save_weights(output: str | Path, params: dict[str, torch.Tensor], model: dict, *,
                 tokenizer: dict | None, note: dict) -> Path:
    """Write ``params`` (by ``GPT.named_parameters`` name, fp32, vocabulary padded as
    ``model`` says) as a sharded checkpoint directory ``output``, which must not exist.
    Everything is written in a temporary directory beside it and renamed at the end: a
    failure leaves nothing behind, and a full disk is one ``OutputError``. ``note`` is
    recorded as the manifest's ``imported``."""
    out = Path(output)
    if os.path.lexists(out):
        raise CheckpointError(f"{out} exists; choose a new --output directory (nothing is "
                              "ever replaced)")
    config = run_config(model)
    datasets: dict = {}
    for name, p in params.items():
        datasets[f"param/{name}"] = p.detach().float().contiguous().numpy()
        for k in KEYS[1:]:
            datasets[f"{k}/{name}"] = Zeros(tuple(p.shape))
    seed = config["train"]["seed"]
    datasets["rng/torch"] = torch.Generator().manual_seed(seed).get_state().numpy()
    with temporary_directory(out) as tmp:  # whole or not at all (hpctrain.atomic)
        crcs = write_shard(tmp / shard_name(0), datasets,
                           {"format": FORMAT, "version": VERSION, "rank": 0, "step": 0})
        manifest = {"format": FORMAT, "version": VERSION, "step": 0, "optimizer_step": 0.0,
                    "layout": "replicated", "world_size": 1, "model": model,
                    "config": config, "tokenizer": tokenizer,
                    "data": {"sampler": config["data"]["sampler"], "seed": seed,
                             "next_step": 0},
                    "index": {"params": {n: list(p.shape) for n, p in params.items()}},
                    "crc32": {shard_name(0): crcs}, "imported": note}
        write_synced(tmp / "manifest.json", json.dumps(manifest, indent=1))
    return out
