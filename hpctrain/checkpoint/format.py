"""The names of the sharded checkpoint format (``sharded.py`` describes it): the tag and
version in the manifest, the step directories and shard files, and the keys of the
manifest's model record. Apart, so that ``validate.py`` and ``sharded.py`` share them
without importing each other."""

from __future__ import annotations

from hpctrain.model.shape import SHAPE_KEYS

FORMAT = "hpctrain-sharded-checkpoint"
VERSION = 1
MODEL_KEYS = SHAPE_KEYS
"""The manifest's ``model`` record is ``GPTConfig.shape()``: n_layer, n_head, n_embd,
block_size, vocab_size and bias, the same keys since version 1."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"
