"""The names of the sharded checkpoint format (``sharded.py`` describes it): the tag and
version in the manifest, the step directories and shard files, and the keys of the
manifest's model record. Apart, so that ``validate.py`` and ``sharded.py`` share them
without importing each other."""

from __future__ import annotations

from hpctrain.model.shape import SHAPE_KEYS

FORMAT = "hpctrain-sharded-checkpoint"
VERSION = 2
READS = (1, 2)
"""The versions this hpctrain reads. Version 2 added ``vocab_multiple`` to the model
record (the embedding's padded rows); a version 1 record lacks it and describes an
unpadded model, which ``upgrade_model_record`` says explicitly."""
MODEL_KEYS = SHAPE_KEYS
"""The manifest's ``model`` record is ``GPTConfig.shape()``: n_layer, n_head, n_embd,
block_size, vocab_size, bias and (since version 2) vocab_multiple."""


def upgrade_model_record(data: dict) -> None:
    """Give a version 1 manifest's model record the key version 2 added, in place, so
    everything after reading sees one form (a v1 checkpoint is an unpadded model)."""
    if data.get("version") == 1 and isinstance(data.get("model"), dict):
        data["model"].setdefault("vocab_multiple", 1)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"
