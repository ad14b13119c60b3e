"""What a sharded checkpoint holds, for comparing two of them: every dataset of every
shard as raw bytes, and the manifest without the options that may differ between the
runs compared (e.g. ``train.ckpt_async``, ``train.out_dir``)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np


def checkpoint_content(directory, ignore_options=("ckpt_async", "out_dir")) -> dict:
    directory = Path(directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    for option in ignore_options:
        manifest["config"]["train"].pop(option, None)
    content = {"manifest": manifest}
    for shard in sorted(directory.glob("rank_*.h5")):
        with h5py.File(shard, "r") as f:
            names = []
            f.visititems(lambda name, obj: names.append(name)
                         if isinstance(obj, h5py.Dataset) else None)
            for name in sorted(names):
                a = np.asarray(f[name][()])
                content[f"{shard.name}:{name}"] = (a.dtype.str, a.shape, a.tobytes())
    return content


def assert_same_checkpoints(a, b) -> None:
    """Every ``step_*`` of checkpoints folder ``a`` holds what the same step of ``b``
    holds, dataset for dataset, byte for byte (and both have the same steps)."""
    steps = sorted(p.name for p in Path(a).glob("step_*"))
    assert steps == sorted(p.name for p in Path(b).glob("step_*")) and steps
    for step in steps:
        ca, cb = checkpoint_content(Path(a) / step), checkpoint_content(Path(b) / step)
        assert ca.keys() == cb.keys(), step
        differ = [k for k in ca if ca[k] != cb[k]]
        assert not differ, f"{step}: {differ[:4]} differ"
