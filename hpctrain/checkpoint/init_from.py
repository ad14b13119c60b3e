"""``--train.init_from``: a new run that starts from the weights of a checkpoint.

Only the parameters come from the checkpoint: the run starts at step 0 with a fresh
AdamW and its learning-rate schedule from the beginning, as fine-tuning wants. Any
checkpoint ``weights.load_weights`` reads reaches this run's layout through the engine's
``load_full_state``. The ``--model.*`` options must describe the checkpoint's model,
except the vocabulary's padding and a shorter (for rotary positions, also longer)
context; a recorded tokenizer must match the data's. ``docs/design/hf-interop.md``
("Fine-tune a published model").
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpctrain.checkpoint.sharded import CheckpointError
from hpctrain.checkpoint.weights import load_weights, model_options
from hpctrain.data.tokenizers import tokenizer_identity
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import SHAPE_KEYS, GPTConfig
from hpctrain.parallel.engine import GradEngine

VOCAB_ROWS = ("wte.weight", "lm_head.weight")


def load_initial_weights(path: str | Path, engine: GradEngine, *, model_shape: dict,
                         tokenizer: dict | None) -> None:
    """Load the parameters of the checkpoint at ``path`` into ``engine`` (every rank; with
    a pipeline each stage takes its own, and the caller re-ties the embedding).
    ``model_shape``: this run's ``GPTConfig.shape()``; ``tokenizer``: its data's record."""
    where = f"--train.init_from={path}"
    params, model, theirs_tok = load_weights(path)
    try:
        theirs_cfg = GPTConfig.from_shape(model)
        theirs = theirs_cfg.shape()
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: its model record is damaged ({e}); start from "
                              "another checkpoint") from None
    differ = [k for k in SHAPE_KEYS if k not in ("vocab_multiple", "block_size")
              and theirs[k] != model_shape[k]]
    if theirs_cfg.position_params() and model_shape["block_size"] > theirs["block_size"]:
        differ.append("block_size")  # learned positions: none past the table's end
    if differ:
        diff = ", ".join(f"{k}={theirs[k]} (this run {model_shape[k]})" for k in differ)
        raise CheckpointError(f"{where} holds another model: {diff}; run with "
                              f"{' '.join(model_options(theirs, differ))}")
    if theirs_tok and tokenizer and tokenizer_identity(theirs_tok) != tokenizer_identity(tokenizer):
        raise CheckpointError(
            f"{where} was made with the {_describe(theirs_tok)} tokenizer, the data with the "
            f"{_describe(tokenizer)} one: the same ids would mean other text; prepare the "
            "data with the checkpoint's tokenizer (for an imported model: hpctrain prepare "
            "--tokenizer hf:MODEL_DIR)")
    engine.load_full_state(_full_state(params, model_shape, where), 0.0)


def _describe(meta: dict) -> str:
    return f"{meta.get('name')} ({meta.get('vocab_size')} tokens)"


def _full_state(params: dict[str, torch.Tensor], model_shape: dict,
                where: str) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter of this run's model with zero moments, the embedding (and an
    untied head) padded to this run's ``vocab_multiple``."""
    cfg = GPTConfig.from_shape(model_shape)
    with torch.device("meta"):  # shapes only: no memory
        shapes = {n: p.shape for n, p in GPT(cfg).named_parameters()}
    missing = sorted(set(shapes) - set(params))
    if missing:
        raise CheckpointError(f"{where} lacks {', '.join(missing[:3])}; the checkpoint is "
                              "damaged: start from another one")
    full = {}
    for name, shape in shapes.items():
        p = params[name].float()
        if name in VOCAB_ROWS:  # the real rows, then this run's padding
            p = p[:cfg.vocab_size]
            p = torch.cat([p, p.new_zeros(shape[0] - p.shape[0], *p.shape[1:])])
        elif name == "wpe.weight":  # a shorter context: the first positions
            p = p[:cfg.block_size]
        if p.shape != shape:
            raise CheckpointError(f"{where}: {name} is {list(p.shape)}, its model record "
                                  f"says {list(shape)}; the checkpoint is damaged: start "
                                  "from another one")
        zeros = torch.zeros(()).expand(shape)  # a fresh AdamW's moments, without memory
        full[name] = {"param": p, "exp_avg": zeros, "exp_avg_sq": zeros}
    return full
