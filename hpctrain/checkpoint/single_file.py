"""One-file checkpoint in HDF5: parameters, AdamW state, config, tokenizer, step.

No pickle: tensors are HDF5 datasets named by parameter, metadata is JSON in attributes.
Written to a temporary name and renamed, so a crash never leaves a half-written file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpctrain.atomic import h5_bytes, reserve_space, temporary_file
from hpctrain.errors import UserError
from hpctrain.sizes import StoredReads

FORMAT = "hpctrain-checkpoint"
VERSION = 1


def save_single_file(path: str | Path, params: dict[str, torch.Tensor],
                     optim: dict[str, dict[str, torch.Tensor]] | None, *, step: int,
                     config: dict, tokenizer: dict) -> Path:
    """Write parameters (fp32) and per-parameter optimizer state to one HDF5 file,
    whole or not at all (``hpctrain.atomic``: a full disk is one ``OutputError``)."""
    path = Path(path)
    tensors = [*params.values(), *(v for s in (optim or {}).values() for v in s.values())]
    with temporary_file(path) as tmp:
        reserve_space(path.parent, h5_bytes([4 * t.numel() for t in tensors]))
        _write(tmp, params, optim, {"format": FORMAT, "version": VERSION, "step": step,
                                    "config": json.dumps(config),
                                    "tokenizer": json.dumps(tokenizer)})
    return path


def _write(tmp: Path, params: dict[str, torch.Tensor],
           optim: dict[str, dict[str, torch.Tensor]] | None, attrs: dict) -> None:
    import h5py

    with h5py.File(tmp, "w") as f:
        f.attrs.update(attrs)
        for name, p in params.items():
            f.create_dataset(f"model/{name}", data=p.detach().float().cpu().numpy())
        for name, state in (optim or {}).items():
            for key, value in state.items():
                f.create_dataset(f"optim/{name}/{key}",
                                 data=value.detach().float().cpu().numpy())
        f.flush()
        os.fsync(f.id.get_vfd_handle())


@dataclass
class Checkpoint:
    step: int
    config: dict
    tokenizer: dict
    model: dict[str, np.ndarray]
    optim: dict[str, dict[str, np.ndarray]]


def load_single_file(path: str | Path) -> Checkpoint:
    import h5py

    path = Path(path)
    if path.is_dir():
        path = path / "final.h5"
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; pass the final.h5 written by "
                        "`hpctrain train` (or its out_dir)")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise UserError(f"checkpoint {path} is not readable HDF5 (truncated?): {e}") from None
    with f:
        if f.attrs.get("format") != FORMAT or int(f.attrs.get("version", -1)) != VERSION:
            raise UserError(f"{path} is not an hpctrain v{VERSION} checkpoint")
        model, optim = {}, {}
        for key, d in _datasets(f, path).items():
            group, _, rest = key.partition("/")
            try:
                a = d[()]
            except (OSError, TypeError, ValueError) as e:
                raise UserError(f"{path}: dataset {key} is unreadable ({e}); the file is "
                                "damaged: use another checkpoint") from None
            if group == "model":
                model[rest] = a
            else:
                name, _, stat = rest.rpartition("/")
                optim.setdefault(name, {})[stat] = a
        try:
            return Checkpoint(int(f.attrs["step"]), json.loads(f.attrs["config"]),
                              json.loads(f.attrs["tokenizer"]), model, optim)
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path}: its step, config or tokenizer attribute is damaged "
                            f"({e}); use another checkpoint") from None


def _datasets(f, path: Path) -> dict:
    """Every dataset under ``model/`` and ``optim/`` by its path in the file, after
    checking, before anything is read, that each is float32 and stored whole, all of
    them within the file (``hpctrain.sizes.StoredReads``). So a damaged or crafted
    declared size is refused instead of becoming an allocation. The file has no index to
    hold the shapes against: the model does that when it takes the weights."""
    import h5py

    found: dict = {}
    for group in ("model", "optim"):
        if isinstance(f.get(group), h5py.Group):
            f[group].visititems(lambda k, v, g=group: found.__setitem__(f"{g}/{k}", v)
                                if isinstance(v, h5py.Dataset) else None)
    if "model" not in f:
        raise UserError(f"{path} has no model weights; use another checkpoint")
    reads = StoredReads(path, error=UserError, fix="the file is damaged or not from "
                                                   "hpctrain: use another checkpoint")
    for key, d in found.items():
        if d.dtype != np.float32 or d.shape is None:
            raise UserError(f"{path}: dataset {key} is {d.dtype}, not the float32 this "
                            "format writes; the file is damaged or not from hpctrain: use "
                            "another checkpoint")
        reads.check(d, key)
    return found
