"""Sharded checkpoints: every rank writes its own HDF5 shard, rank 0 a JSON manifest.

A checkpoint is a ``step_N`` directory of per-rank shards (fp32 parameters, Adam
moments, RNG state) and a manifest with the layout, the tensor index and a CRC-32 of
every dataset; ``latest`` names the newest complete one. A save goes through a hidden
temporary directory, fsyncs and renames, so a crash leaves the previous checkpoint and
``latest`` intact. Two layouts, ``replicated`` and ``zero``; ``read_full_state`` turns
either into whole tensors, so a checkpoint loads at any world size and ZeRO level.
Nothing is pickled. ``docs/design/checkpoints.md``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpctrain.atomic import h5_bytes, reserve_space
from hpctrain.checkpoint.format import (FORMAT, MODEL_KEYS, READS, VERSION, CheckpointError,
                                        shard_locations, shard_name, step_dir_name,
                                        upgrade_model_record)
from hpctrain.checkpoint.shard_file import ShardFile, crc32_of
from hpctrain.checkpoint.validate import Damaged, describe, validate_manifest
from hpctrain.data.format import crc32_combine
from hpctrain.file_modes import chmod_as_created
from hpctrain.model.shape import GPTConfig
from hpctrain.parallel.tensor.layout import join_expert_slices, join_slices

KEYS = ("param", "exp_avg", "exp_avg_sq")
STEP_NAME = re.compile(r"step_(\d+)")
# What a killed save leaves behind: mkdtemp's and mkstemp's names (random part: letters,
# digits, underscore). Nothing else under checkpoints/ is ever deleted as a leftover.
STALE_TEMPORARIES = (re.compile(r"\.step_\d+\.[A-Za-z0-9_]+\.tmp"),
                     re.compile(r"\.latest\.[A-Za-z0-9_]+"))
LATEST_MAX_BYTES = 4096


def bucket_entry(names: list[str], shapes: list[list[int]], layout) -> dict:
    """The manifest's record of one bucket: which parameter lies where, and the shards
    (``layout``: a ``parallel.shards.ShardLayout``)."""
    return {"names": list(names), "shapes": [list(s) for s in shapes],
            "offsets": list(layout.offsets), "shard": layout.shard, "world": layout.world}

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- writing

def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Zeros:
    """A float32 dataset of zeros that ``write_shard`` never writes: chunked with fill
    value 0 and no chunk allocated, it reads as zeros and takes no disk space (the Adam
    moments of a checkpoint made from weights alone, ``weights.py``)."""
    shape: tuple[int, ...]


def zeros_crc32(nbytes: int) -> int:
    """CRC-32 of ``nbytes`` zero bytes, without making them: two halves joined by
    ``crc32_combine`` (logarithmic in ``nbytes``)."""
    if nbytes <= 1 << 24:
        return zlib.crc32(bytes(nbytes))
    half = zeros_crc32(nbytes // 2)
    both = crc32_combine(half, half, nbytes // 2)
    return crc32_combine(both, zlib.crc32(bytes(nbytes % 2)), nbytes % 2)


def write_shard(path: Path, datasets: dict[str, np.ndarray | Zeros],
                attrs: dict, piece_bytes: int = 0) -> dict[str, int]:
    """Write one rank's shard; return the CRC-32 of each dataset. The room is made sure
    of first (``atomic.reserve_space``: HDF5 crashes on a full disk). ``piece_bytes``:
    write larger datasets in pieces of about this size (the same dataset: a writer
    thread holds h5py's global lock for one write call at a time, and the main thread's
    h5py calls, e.g. the h5mpio reader's, wait for it)."""
    import h5py

    reserve_space(path.parent, h5_bytes([a.nbytes for a in datasets.values()
                                         if not isinstance(a, Zeros)]))
    with h5py.File(path, "w") as f:
        f.attrs.update(attrs)
        crcs = write_datasets(f, datasets, piece_bytes)
        f.flush()
        os.fsync(f.id.get_vfd_handle())
    return crcs


def write_datasets(group, datasets: dict[str, np.ndarray | Zeros],
                   piece_bytes: int = 0) -> dict[str, int]:
    """Write ``datasets`` into an open HDF5 file or group (``write_shard``; a node file
    holds a group per rank); return the CRC-32 of each."""
    crcs = {}
    for name, a in datasets.items():
        if isinstance(a, Zeros):
            group.create_dataset(name, shape=a.shape, dtype=np.float32, fillvalue=0.0,
                                 chunks=True)
            crcs[name] = zeros_crc32(4 * math.prod(a.shape))
            continue
        if piece_bytes and a.ndim and a.nbytes > piece_bytes:
            d = group.create_dataset(name, shape=a.shape, dtype=a.dtype)
            rows = max(1, piece_bytes // max(1, a[0].nbytes))
            for lo in range(0, a.shape[0], rows):
                d[lo:lo + rows] = a[lo:lo + rows]
        else:
            group.create_dataset(name, data=a)
        crcs[name] = crc32_of(a)
    return crcs


def publish(tmp: Path, root: Path, step: int, keep: int, prune_later: bool = False) -> Path:
    """Rank 0, after every shard and the manifest are on disk: make ``tmp`` the
    checkpoint of ``step``, point ``latest`` at it, drop the oldest beyond ``keep``
    (``prune_later``: in a thread of its own, ``prune_in_background``)."""
    final = root / step_dir_name(step)
    chmod_as_created(tmp)  # mkdtemp made it 0700: teammates could not read it
    _fsync_dir(tmp)
    if final.exists():  # a re-run of the same step: replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    point_latest(root, final.name)
    if prune_later:
        prune_in_background(root, final, keep)
    else:
        prune(root, final, keep)
    return final


_pruning: threading.Thread | None = None


def prune_in_background(root: Path, newest: Path, keep: int) -> None:
    """``prune`` in a thread, after the previous one has finished: deleting a checkpoint
    of many GB takes the file system a while, and an asynchronous save must not stall
    training for it. The thread is not a daemon: the process waits for it at its end,
    so a normal exit never leaves a checkpoint half deleted."""
    global _pruning
    wait_for_pruning()
    _pruning = threading.Thread(target=prune, args=(root, newest, keep),
                                name="hpctrain-ckpt-prune")
    _pruning.start()


def wait_for_pruning() -> None:
    """Block until the background deletion (if any) is done."""
    if _pruning is not None:
        _pruning.join()


def point_latest(root: Path, name: str) -> None:
    """Replace ``root/latest`` atomically (write, fsync, rename) with ``name``."""
    fd, latest_tmp = tempfile.mkstemp(prefix=".latest.", dir=root)
    os.close(fd)
    try:
        write_synced(Path(latest_tmp), name + "\n")
        chmod_as_created(latest_tmp)
        os.replace(latest_tmp, root / "latest")
    except BaseException:
        Path(latest_tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(root)


def checkpoint_step(d: Path) -> int | None:
    """The step of checkpoint directory ``d``: its manifest's, else the number in its
    name; None when neither can be read."""
    try:
        step = json.loads((d / "manifest.json").read_text()).get("step")
        if type(step) is int and step >= 0:
            return step
    except (OSError, ValueError, RecursionError, AttributeError):
        pass  # missing, unreadable, not JSON, not an object: go by the name
    m = STEP_NAME.fullmatch(d.name)
    return int(m.group(1)) if m else None


def prune(root: Path, newest: Path, keep: int) -> list[Path]:
    """Delete the checkpoints beyond ``keep``: ``newest`` (the one ``latest`` names)
    stays, and so do the ``keep - 1`` others with the highest steps; returns the deleted.

    Steps, not names, decide: names sort wrongly past step 999999, and an out_dir may
    hold higher steps than the run now saving (an earlier, longer run), whose newest
    checkpoint must not be the one deleted. A directory whose step cannot be told is
    never touched, and temporaries (hidden names) are not checkpoints."""
    if keep <= 0:
        return []
    others = []
    for d in root.glob("step_*"):
        if d.name == newest.name or d.is_symlink() or not d.is_dir():
            continue
        step = checkpoint_step(d)
        if step is not None:
            others.append((step, d.name, d))
    others.sort(reverse=True)
    removed = [d for _, _, d in others[keep - 1:]]
    for d in removed:
        shutil.rmtree(d, ignore_errors=True)
    return removed


def remove_stale_temporaries(root: str | Path) -> list[Path]:
    """Delete what killed saves left under a ``checkpoints/`` root (``.step_*.tmp``
    directories, ``.latest.*`` files); return what was removed.

    Only for rank 0 at start-up, while it holds the run directory: a temporary of a save
    in progress looks the same. A name that cannot be removed is left (nothing reads
    temporaries, so it is harmless)."""
    root = Path(root)
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for p in entries:
        if not any(pattern.fullmatch(p.name) for pattern in STALE_TEMPORARIES):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed


# ----------------------------------------------------------------------------- reading

@dataclass
class Manifest:
    path: Path
    data: dict

    @property
    def step(self) -> int:
        return int(self.data["step"])

    @property
    def world_size(self) -> int:
        return int(self.data["world_size"])

    @functools.cached_property
    def locations(self) -> list[tuple[str, str]]:
        """Each rank's ``(file, group)`` (``format.shard_locations``)."""
        return shard_locations(self.data)

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel ranks it was written with (1 in checkpoints before them)."""
        return int(self.data.get("tensor_parallel", 1))

    @property
    def expert_parallel(self) -> int:
        """The expert-parallel ranks it was written with (1 in checkpoints before them)."""
        return int(self.data.get("expert_parallel", 1))


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or a ``checkpoints/`` root (its ``latest``), or a run's
    out_dir (its ``checkpoints/latest``)."""
    p = Path(path)
    for root in (p, p / "checkpoints"):
        latest = root / "latest"
        if latest.is_file():
            return root / latest_name(latest)
    return p


def latest_name(latest: Path) -> str:
    """The directory ``latest`` names, which must lie beside it: a plain name (no ``/``,
    not ``..`` or hidden), so that a damaged or crafted file cannot send a load to
    another place on the filesystem, or to a temporary."""
    fix = (f"write the name of one of the step_N directories beside it into {latest}, or "
           "pass that directory itself")
    try:
        with open(latest, "rb") as f:
            raw = f.read(LATEST_MAX_BYTES + 1)
        name = raw.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest} is unreadable ({e}); {fix}") from None
    if (len(raw) > LATEST_MAX_BYTES or not name or name.startswith(".")
            or any(c in name for c in "/\\\0\n")):
        raise CheckpointError(f"{latest} names {name[:80]!r}, not a checkpoint directory "
                              f"beside it (a plain name like step_000100); {fix}")
    return name


def read_manifest(path: str | Path) -> Manifest:
    d = resolve(path)
    mf = d / "manifest.json"
    if not mf.is_file():
        raise CheckpointError(f"{d} is not a complete checkpoint (no manifest.json); pass a "
                              "checkpoints/step_N directory, or the run's out_dir to use its "
                              "latest checkpoint")
    try:
        data = json.loads(mf.read_text())
    except (ValueError, RecursionError) as e:  # ValueError: also not UTF-8
        raise CheckpointError(f"{mf} is not valid JSON ({e}): the checkpoint is damaged; "
                              "resume from an older step_N directory") from None
    except OSError as e:
        raise CheckpointError(f"{mf} is unreadable ({e}); check its permissions, or "
                              "resume from an older step_N directory") from None
    if (not isinstance(data, dict) or data.get("format") != FORMAT
            or data.get("version") not in READS):
        raise CheckpointError(f"{mf} is not an hpctrain sharded checkpoint of version "
                              f"{', '.join(map(str, READS[:-1]))} or {READS[-1]}")
    upgrade_model_record(data)
    try:
        validate_manifest(data)
    except Damaged as e:
        raise CheckpointError(describe(mf, e)) from None
    return Manifest(d, data)


def check_compatible(manifest: Manifest, model_shape: dict) -> None:
    theirs = manifest.data["model"]
    differ = [k for k in MODEL_KEYS if theirs.get(k) != model_shape[k]]
    if not differ:
        return
    fix = "resume with the same --model.* options, or start a new --train.out_dir"
    if differ == ["vocab_multiple"]:  # e.g. a checkpoint from before vocabulary padding
        fix = f"resume with --model.vocab_multiple={theirs['vocab_multiple']}"
    diff = ", ".join(f"{k}={theirs.get(k)} (yours {model_shape[k]})" for k in differ)
    raise CheckpointError(f"checkpoint {manifest.path} was made for another model: {diff}; "
                          f"{fix}")


def _open_shard(manifest: Manifest, rank: int) -> ShardFile:
    return ShardFile(manifest.path, rank, manifest.data["crc32"][shard_name(rank)],
                     manifest.locations[rank])


def bucket_ranks(manifest: Manifest, entry: dict) -> list[int]:
    """World ranks holding the shards of a bucket, in shard order (all ranks unless the
    checkpoint comes from a pipeline, where each stage has its own buckets)."""
    return entry.get("ranks", list(range(manifest.world_size)))


def bucket_key(entry: dict, i: int) -> str:
    return entry.get("key", f"bucket_{i}")


def read_full_state(manifest: Manifest, keys: tuple[str, ...] = KEYS
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """Whole fp32 parameters and Adam moments by parameter name, from any layout;
    ``keys=("param",)`` reads the parameters alone (``--train.init_from``). The slices
    of a tensor-parallel checkpoint (``name@tp<r>``) and of an expert-parallel one
    (``name@ep<r>``) are joined into whole tensors."""
    state = _read_recorded(manifest, keys)
    tp = manifest.tensor_parallel
    try:
        state = join_expert_slices(state, manifest.expert_parallel)
        return join_slices(state, GPTConfig.from_shape(manifest.data["model"]), tp)
    except KeyError as e:
        raise CheckpointError(f"checkpoint {manifest.path}: a tensor- or expert-parallel slice is "
                              f"missing from its index ({e}); the checkpoint is damaged: "
                              "resume from an older step_N directory") from None


def _read_recorded(manifest: Manifest, keys: tuple[str, ...]
                   ) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor the index records, by its recorded name."""
    data = manifest.data
    out: dict[str, dict[str, torch.Tensor]] = {}
    if data["layout"] == "replicated":
        # One writer per pipeline stage (rank 0 alone without a pipeline).
        owners = data["index"].get("owners", {})
        by_rank: dict[int, list[str]] = {}
        for name in data["index"]["params"]:
            by_rank.setdefault(int(owners.get(name, 0)), []).append(name)
        for rank, names in sorted(by_rank.items()):
            with _open_shard(manifest, rank) as shard:
                for name in names:
                    shape = tuple(data["index"]["params"][name])
                    out[name] = {k: torch.from_numpy(shard.read(f"{k}/{name}", shape))
                                 for k in keys}
        return out
    buckets = data["index"]["buckets"]
    flats = [{k: [] for k in keys} for _ in buckets]
    for rank in range(manifest.world_size):
        mine = [i for i, b in enumerate(buckets) if rank in bucket_ranks(manifest, b)]
        if not mine:
            continue
        with _open_shard(manifest, rank) as shard:
            for i in mine:
                for k in keys:
                    flats[i][k].append(_read_bucket(shard, buckets[i], i, k))
    for i, b in enumerate(buckets):
        full = {k: np.concatenate(flats[i][k]) for k in keys}
        for name, shape, off in zip(b["names"], b["shapes"], b["offsets"]):
            n = math.prod(shape)  # inside the bucket: validate_manifest checked
            out[name] = {k: torch.from_numpy(full[k][off:off + n].copy()).reshape(shape)
                         for k in keys}
    return out


def read_own_shards(manifest: Manifest, rank: int) -> list[dict[str, np.ndarray]]:
    """This rank's slices of every bucket it holds (``param``, ``exp_avg``,
    ``exp_avg_sq``), for a resume with the layout the checkpoint was written with: 1/N
    of the reading."""
    buckets = manifest.data["index"]["buckets"]
    with _open_shard(manifest, rank) as shard:
        return [{k: _read_bucket(shard, b, i, k) for k in KEYS}
                for i, b in enumerate(buckets) if rank in bucket_ranks(manifest, b)]


def _read_bucket(shard: ShardFile, entry: dict, i: int, k: str) -> np.ndarray:
    """One rank's slice of bucket ``i``: ``entry["shard"]`` elements."""
    return shard.read(f"{bucket_key(entry, i)}/{k}", (entry["shard"],))


def read_rng(manifest: Manifest, rank: int) -> torch.Tensor:
    """A rank's torch RNG state; it must have the size this torch's state has, which is
    what ``torch.set_rng_state`` takes."""
    size = torch.get_rng_state().numel()
    with _open_shard(manifest, rank) as shard:
        return torch.from_numpy(shard.read("rng/torch", (size,), np.uint8))
