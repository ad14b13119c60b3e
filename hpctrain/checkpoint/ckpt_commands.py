"""``hpctrain ckpt inspect | merge | export | reshard``: look into and convert sharded
checkpoints on one process, without MPI (a checkpoint of any world size reads the same
way). ``ckpt import`` is ``hf_import.py``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from hpctrain.atomic import temporary_directory
from hpctrain.checkpoint.export import export_hf, unpadded, write_safetensors
from hpctrain.checkpoint.sharded import (FORMAT, KEYS, VERSION, CheckpointError, bucket_entry,
                                         read_full_state, read_manifest, read_rng,
                                         shard_name, write_shard, write_synced)
from hpctrain.checkpoint.single_file import save_single_file
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.output_paths import check_output_file, check_output_folder
from hpctrain.parallel.choose_engine import engine_class
from hpctrain.parallel.shards import shard_layout
from hpctrain.parallel.tensor.layout import EXPERT_QUALIFIER, QUALIFIER
from hpctrain.parallel.zero.buckets import ALIGN, pack_flat, zero_buckets
from hpctrain.sizes import MAX_WORLD, MiB, finite, whole

MAX_BUCKET_MB = float(1 << 20)


def inspect(path: str | Path, verify: bool = False) -> str:
    m = read_manifest(path)
    d = m.data
    n_params = sum(math.prod(s) for s in _shapes(d).values())
    shards = [m.path / f for f in dict.fromkeys(f for f, _ in m.locations)]
    # config and data are only described here, never used: validate_manifest does not
    # hold them to a schema, so a missing key shows as None
    config = d["config"]
    data = d["data"] if isinstance(d.get("data"), dict) else {}
    lines = [f"checkpoint {m.path}",
             f"  step {m.step} (Adam step {d['optimizer_step']:g}), {d['layout']} layout, "
             f"{m.world_size} rank(s), ZeRO level {_get(config, 'parallel', 'zero')}, "
             f"dtype {_get(config, 'train', 'dtype')}",
             "  model " + ", ".join(f"{k}={v}" for k, v in d["model"].items()),
             f"  {len(_whole_names(_shapes(d)))} tensors, {n_params:,} parameters",
             f"  data: {data.get('sampler')} sampler, seed {data.get('seed')}, next step "
             f"{data.get('next_step')}",
             *([f"  imported from {d['imported'].get('from')} {d['imported'].get('path')} "
                f"(weights only: step 0, Adam moments zero)"]
               if isinstance(d.get("imported"), dict) else []),
             "  shards: " + ", ".join(f"{p.name} ({p.stat().st_size / MiB:.1f} MiB)"
                                      if p.exists() else f"{p.name} (MISSING)" for p in shards)]
    if verify:
        read_full_state(m)  # reads every dataset and checks its CRC-32
        lines.append("  verified: every dataset matches its CRC-32")
    return "\n".join(lines)


def _get(d: dict, section: str, key: str):
    part = d.get(section)
    return part.get(key) if isinstance(part, dict) else None


def _shapes(d: dict) -> dict[str, list[int]]:
    if d["layout"] == "replicated":
        return d["index"]["params"]
    return {n: s for b in d["index"]["buckets"] for n, s in zip(b["names"], b["shapes"])}


def _whole_names(shapes: dict) -> set[str]:
    """The model's tensors behind a checkpoint's entries: a tensor- or expert-parallel
    run records one entry per slice (``name@tp<r>``, ``name@ep<r>``), counted once."""
    return {n.split(QUALIFIER)[0].split(EXPERT_QUALIFIER)[0] for n in shapes}


def merge(path: str | Path, output: str | Path) -> Path:
    """All shards into one HDF5 file in the ``final.h5`` format (``hpctrain sample``)."""
    check_output_file(output, inputs=[path], example="model.h5", error=CheckpointError)
    m = read_manifest(path)
    full = read_full_state(m)
    params = {n: s["param"] for n, s in full.items()}
    optim = {n: {k: s[k] for k in KEYS[1:]} for n, s in full.items()}
    for s in optim.values():
        s["step"] = torch.tensor(float(m.data["optimizer_step"]))
    return save_single_file(output, params, optim, step=m.step, config=m.data["config"],
                            tokenizer=m.data.get("tokenizer") or {})


def export(path: str | Path, fmt: str, output: str | Path) -> Path:
    if fmt == "dcp":  # a new folder: torch Distributed Checkpoint (dcp.py)
        from hpctrain.checkpoint.dcp import export_dcp

        return export_dcp(path, output)
    if fmt == "hf":  # a folder, written into when it exists (an earlier export)
        check_output_folder(output, inputs=[path], new=False, error=CheckpointError)
    else:
        check_output_file(output, inputs=[path], example="model.safetensors",
                          error=CheckpointError)
    m = read_manifest(path)
    params = {n: s["param"] for n, s in read_full_state(m, ("param",)).items()}
    if fmt == "safetensors":
        return write_safetensors(Path(output), unpadded(params, m.data["model"]),
                                 {"format": "pt", "hpctrain_step": str(m.step)})
    if fmt == "hf":
        return export_hf(output, params, m.data["model"], m.data.get("tokenizer"))
    raise CheckpointError(f"unknown export format {fmt!r}; use safetensors, hf or dcp")


def reshard(path: str | Path, output: str | Path, *, world: int, zero: int,
            bucket_mb: float = 25.0, first_bucket_mb: float = 1.0) -> Path:
    """Rewrite a checkpoint for ``world`` ranks at ZeRO level ``zero`` (bucket caps as in
    ``--parallel.*``), so that such a run reads only its own shard when it resumes. Any
    checkpoint also loads at any layout directly; this saves each rank the reshuffle."""
    whole(world, "--world", 1, MAX_WORLD, error=CheckpointError,
          fix="give the number of ranks of the run that will resume")
    if zero not in (0, 1, 2, 3):
        raise CheckpointError(f"--zero {zero}: use a ZeRO level 0-3")
    for option, mb in (("--bucket-mb", bucket_mb), ("--first-bucket-mb", first_bucket_mb)):
        finite(mb, option, 0.0, MAX_BUCKET_MB, low_open=True, error=CheckpointError,
               fix="give the --parallel.* value of the run that will resume")
    m = read_manifest(path)
    full = read_full_state(m)
    out = check_output_folder(output, inputs=[path], error=CheckpointError)
    with torch.device("meta"):  # only names, shapes and order: no memory
        model = GPT(GPTConfig.from_shape(m.data["model"]))
    names = {id(p): n for n, p in model.named_parameters()}
    config = json.loads(json.dumps(m.data["config"]))
    if not (isinstance(config.get("parallel"), dict) and isinstance(config.get("train"), dict)
            and config["train"].get("dtype") in ("fp32", "bf16")):
        raise CheckpointError(f"{m.path}/manifest.json: its config lacks the parallel or "
                              "train settings (train.dtype); the checkpoint is damaged: "
                              "reshard an older step_N directory")
    # the new layout: whole tensors, ZeRO over every rank, no pipeline, tensor or
    # context split
    config["parallel"].update(zero=zero, bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb,
                              pp=1, tp=1, cp=1, sequence_parallel=False)
    shards: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    if engine_class(zero, config["train"]["dtype"]).state_kind == "replicated":
        layout, index = "replicated", {"params": {n: list(s["param"].shape)
                                                  for n, s in full.items()}}
        for n, s in full.items():
            for k in KEYS:
                shards[0][f"{k}/{n}"] = s[k].numpy()
    else:
        layout, buckets = "zero", []
        groups = zero_buckets(model, zero, list(model.h), bucket_mb, first_bucket_mb)
        for i, params in enumerate(groups):
            lay = shard_layout([p.numel() for p in params], world if zero else 1, ALIGN)
            buckets.append(bucket_entry([names[id(p)] for p in params],
                                        [list(p.shape) for p in params], lay))
            for k in KEYS:
                flat = pack_flat(lay, [full[names[id(p)]][k] for p in params]).numpy()
                for r in range(world):
                    lo, hi = lay.rank_range(r if zero else 0)
                    shards[r][f"bucket_{i}/{k}"] = flat[lo:hi]
        index = {"buckets": buckets}
    rng = read_rng(m, 0).numpy()  # every new rank starts from the old rank 0's RNG state
    with temporary_directory(out) as tmp:  # whole or not at all, a full disk one message
        crcs = {}
        for r in range(world):
            shards[r]["rng/torch"] = rng
            crcs[shard_name(r)] = write_shard(tmp / shard_name(r), shards[r],
                                              {"format": FORMAT, "version": VERSION,
                                               "rank": r, "step": m.step})
        manifest = {**{k: v for k, v in m.data.items() if k != "node_files"},
                    "version": VERSION, "layout": layout, "world_size": world,
                    "tensor_parallel": 1, "config": config, "index": index, "crc32": crcs}
        write_synced(tmp / "manifest.json", json.dumps(manifest, indent=1))
    return out

