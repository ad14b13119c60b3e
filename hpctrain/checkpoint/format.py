"""The names of the sharded checkpoint format (``sharded.py`` describes it): the tag and
version in the manifest, the step directories and shard files, and the keys of the
manifest's model record. Apart, so that ``validate.py`` and ``sharded.py`` share them
without importing each other."""

from __future__ import annotations

import re

from hpctrain.errors import UserError
from hpctrain.model.shape import SHAPE_KEYS, GPTConfig

class CheckpointError(UserError):
    """A checkpoint is missing, corrupt, or does not fit the model being trained."""


FORMAT = "hpctrain-sharded-checkpoint"
VERSION = 5
READS = (1, 2, 3, 4, 5)
"""The versions this hpctrain reads. Version 2 added ``vocab_multiple`` to the model
record (the embedding's padded rows); version 3 the architecture's keys (``arch``,
``n_kv_head``, ``ffn_hidden``, ``rope_theta``, ``rope_scaling``, ``norm_eps``,
``tie_embeddings``). An older record lacks them and describes an unpadded (v1) GPT-2
model, which ``upgrade_model_record`` says explicitly. Version 4 added the optional
``node_files`` (one file per node, ``shard_locations``); without it every rank's shard
is its own file, as before. Version 5 added the mixture-of-experts keys (``moe_*``)
and ``qkv_bias``; an older record describes a dense model without them."""
MODEL_KEYS = SHAPE_KEYS
"""The manifest's ``model`` record is ``GPTConfig.shape()``: n_layer, n_head, n_embd,
block_size, vocab_size, bias, (since version 2) vocab_multiple and (since version 3) the
architecture's keys."""


def upgrade_model_record(data: dict) -> None:
    """Give an older manifest's model record the keys later versions added, in place, so
    everything after reading sees one form: the values ``GPTConfig.from_shape`` gives a
    record without them (v1: unpadded; v1 and v2: GPT-2; before MoE: dense, no query/key/
    value biases alone). A record too damaged for that is left for ``validate_manifest``
    to name."""
    model = data.get("model")
    if isinstance(model, dict):
        try:
            full = GPTConfig.from_shape(model).shape()
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return
        for k, v in full.items():
            model.setdefault(k, v)


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.h5"


NODE_FILE_NAME = re.compile(r"node_\d{5,}\.h5")


def node_file_name(node: int) -> str:
    return f"node_{node:05d}.h5"


def shard_group(rank: int) -> str:
    """The HDF5 group of rank ``rank``'s shard inside a node file."""
    return f"rank_{rank:05d}"


def shard_locations(data: dict) -> list[tuple[str, str]]:
    """Where each rank's shard lies, by rank: ``(file, group)``, the group ``""`` being
    the file's root. Without ``node_files`` a rank's shard is its own file
    (``rank_00003.h5``); with it (``{"node_00001.h5": [2, 3], ...}``, version 4) the shards
    of a node's ranks are groups ``rank_00002``, ``rank_00003`` of that node's file.
    Every reader finds a shard here (``validate_manifest`` has checked ``node_files``)."""
    files = data.get("node_files")
    if not files:
        return [(shard_name(r), "") for r in range(int(data["world_size"]))]
    where: list[tuple[str, str]] = [("", "")] * int(data["world_size"])
    for name, ranks in files.items():
        for r in ranks:
            where[r] = (name, shard_group(r))
    return where
