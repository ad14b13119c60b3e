"""Saving and loading sharded checkpoints across the ranks of a job (``sharded.py`` has
the on-disk format). Both are collective: every rank calls them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from hpctrain.checkpoint.host_buffers import HostBuffers, available_bytes, copy_bytes
from hpctrain.checkpoint.node_files import write_node_file
from hpctrain.checkpoint.sharded import (FORMAT, KEYS, VERSION, CheckpointError,
                                         bucket_entry,
                                         bucket_key, bucket_ranks, check_compatible,
                                         publish, read_full_state,
                                         read_manifest, read_own_shards, read_rng, shard_name,
                                         write_shard,
                                         write_synced)
from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.mpi import MPI
from hpctrain.comm.small_collectives import allreduce_array, bcast_json, gather_json
from hpctrain.comm.world import World
from hpctrain.parallel.engine import GradEngine
from hpctrain.parallel.tensor.split_state import TensorSplit


def _is_expert(split: TensorSplit, name: str) -> bool:
    return split.experts is not None and name in split.experts.specs


def _replicated_shard(state, split: TensorSplit, writes: bool, writes_experts: bool):
    """Plain data parallelism: one rank (per pipeline stage) writes every parameter of
    its model and their moments by name; under tensor parallelism each rank of the
    group writes its slices (``name@tp<r>``) and the group's first the whole rest; under
    expert parallelism the first holder of each slice of the experts writes it
    (``name@ep<r>``, ``writes_experts``) and replica 0 the rest."""
    names = {n: split.qualified(n) for n in state.params
             if (writes_experts if _is_expert(split, n) else
                 writes and (split.rank == 0 or split.qualified(n) != n))}
    index = {"params": {names[n]: list(state.params[n]["param"].shape) for n in names}}
    sources = {}
    if writes or writes_experts:
        for name, qualified in names.items():
            for k in KEYS:
                sources[f"{k}/{qualified}"] = state.params[name][k]
    return index, sources


def _zero_index(state, grid: ProcessGrid, split: TensorSplit) -> dict:
    entries = [bucket_entry([split.qualified(n) for n in b.names], b.shapes, b.layout)
               for b in state.buckets]
    if grid.pp > 1 or grid.tp > 1 or grid.ep > 1:  # buckets that live on some ranks only
        where = f"stage{grid.stage}_" + (f"tp{grid.tp_index}_" if grid.tp > 1 else "")
        for i, (e, b) in enumerate(zip(entries, state.buckets)):
            if _is_expert(split, b.names[0]):  # this slice of the experts' holders
                e.update(ranks=grid.expert_ranks(), key=f"{where}ep{grid.ep_index}_bucket_{i}")
            else:
                e.update(ranks=grid.stage_ranks(), key=f"{where}bucket_{i}")
    return {"buckets": entries}


def _zero_shard(state, grid: ProcessGrid, split: TensorSplit):
    index = _zero_index(state, grid, split)
    sources = {}
    for i, (entry, b) in enumerate(zip(index["buckets"], state.buckets)):
        for k in KEYS:
            sources[f"{bucket_key(entry, i)}/{k}"] = b.tensors[k]
    return index, sources


def _to_numpy(t: torch.Tensor):
    """A dataset of a synchronous save: the tensor itself where it is fp32 on the host
    (written before training goes on), else an fp32 host copy."""
    return (t.detach().float() if t.is_floating_point() else t.detach()).cpu().numpy()


def _merge_stage_indexes(world: World, grid: ProcessGrid, layout: str, index: dict,
                         what: str) -> dict | None:
    """The whole model's index on rank 0, from replica 0's stages (collective); under
    expert parallelism also from the first holder of each slice of the experts."""
    mine = index if grid.expert_world.rank == 0 else None  # replica 0, context rank 0
    if mine is not None and layout == "replicated":
        mine = {**mine, "owners": {n: world.rank for n in mine["params"]}}
    if mine is not None:
        mine = {**mine, "stage": grid.stage}
    parts = [p for p in gather_json(world.comm, mine, timeout=world.timeout, what=what) or []
             if p is not None]
    if not world.is_root:
        return None
    if layout == "replicated":
        return {"params": {n: s for p in parts for n, s in p["params"].items()},
                "owners": {n: r for p in parts for n, r in p["owners"].items()}}
    if grid.ep == 1:
        return {"buckets": [b for p in parts for b in p["buckets"]]}
    return {"buckets": _interleave(parts, grid.pp)}


def _interleave(parts: list[dict], stages: int) -> list[dict]:
    """Expert parallelism: each stage's buckets once, in bucket order, a bucket of
    experts followed by the other slices' (each rank finds its own in its own order)."""
    out = []
    for stage in range(stages):
        lists = [p["buckets"] for p in parts if p["stage"] == stage]
        seen = set()
        for i in range(max(len(b) for b in lists)):
            for buckets in lists:
                if i < len(buckets) and buckets[i]["key"] not in seen:
                    seen.add(buckets[i]["key"])
                    out.append(buckets[i])
    return out


SLOW_SAVE_ENV = "HPCTRAIN_TEST_SLOW_SAVE_S"
WRITER_PIECE_BYTES = 16 * 2**20
"""The writer thread writes a dataset in pieces of this size: h5py holds its global lock
for each write call, which the main thread's h5py calls wait for (tens of ms at most)."""


class PendingSave:
    """A checkpoint whose shards are being written; ``finish()`` publishes it (collective).

    With ``ready`` (an asynchronous save: the datasets are a copy in host buffers) a
    thread writes the shard while training goes on, after ``ready()`` says the copy is
    complete; ``written`` tells when it is done. ``finish()`` waits for the thread,
    gathers every rank's checksums, writes the manifest and renames the directory into
    place. All ranks must call ``finish()`` at the same point of the program. The thread
    makes no MPI call: every agreement is the main thread's."""

    def __init__(self, root: Path, step: int, tmp: Path, world: World, datasets: dict,
                 manifest: dict, keep: int, ready=None, note: str = "", files: str = "rank"):
        self.root, self.step, self.tmp, self.world, self.keep = root, step, tmp, world, keep
        self.files = files
        """``rank``: a file per rank; ``node``: a file per node (``node_files.py``)."""
        self.manifest = manifest
        self.note = note
        """Why a save asked to be asynchronous is not ('' when it is, or was not asked)."""
        self._datasets = datasets
        self._result: list = [{}, "not written", {}]
        """[CRC-32s by shard name, error or None, node files written here]"""
        self._thread = None
        if ready is not None:
            self._thread = threading.Thread(target=self._write, args=(ready,), daemon=True,
                                            name=f"hpctrain-ckpt-{step}")
            self._thread.start()
        else:
            self._write()

    @property
    def in_background(self) -> bool:
        return self._thread is not None

    @property
    def written(self) -> bool:
        """This rank's shard is written and fsynced, or its write failed (local)."""
        return self._thread is None or not self._thread.is_alive()

    def _write(self, ready=None) -> None:
        w = self.world
        # Test-only: a save this many seconds slower (tests of --train.time_limit).
        time.sleep(float(os.environ.get(SLOW_SAVE_ENV, "0") or 0))
        try:
            if ready is not None:
                ready()  # the copy from the device has landed
            attrs = {"format": FORMAT, "version": VERSION, "rank": w.rank, "step": self.step}
            if self.files == "node":  # collective over the node: never in the thread
                crcs, written = write_node_file(w, self.tmp, self._datasets, attrs)
                self._result = [crcs, None, written]
            else:
                crcs = write_shard(self.tmp / shard_name(w.rank), self._datasets, attrs,
                                   piece_bytes=WRITER_PIECE_BYTES if ready is not None else 0)
                self._result = [{shard_name(w.rank): crcs}, None, {}]
        except Exception as e:  # noqa: BLE001 - h5py reports a full disk as RuntimeError
            # Whatever it is, it must reach finish(), which tells every rank: raised here,
            # on one rank, it would leave the others waiting in finish()'s collective.
            self._result = [{}, f"rank {w.rank}: {_what(e)}", {}]
        self._datasets = None  # the buffers are the saver's again

    def finish(self) -> Path:
        w, step = self.world, self.step
        if self._thread is not None:
            self._thread.join()
        what = f"checkpoint save (step {step})"
        results = gather_json(w.comm, self._result, timeout=w.timeout, what=what)
        outcome = self._publish(results) if w.is_root else None
        status, detail = bcast_json(w.comm, outcome, timeout=w.timeout, what=what)
        if status != "ok":
            raise CheckpointError(detail)
        return Path(detail)

    def _publish(self, results: list) -> list[str]:
        """Rank 0: write the manifest and publish, or report why not as
        ``["error", message]`` (every rank raises it). On any failure the temporary
        directory goes and the previous checkpoint and ``latest`` stay as they were."""
        errors = [e for _, e, _ in results if e]
        crc32 = {k: c for crcs, _, _ in results for k, c in crcs.items()}
        files = {k: ranks for _, _, written in results for k, ranks in written.items()}
        lost = [r for r in range(len(results)) if shard_name(r) not in crc32]
        if not errors and lost:  # a writer that left a rank out: a bug, never published
            errors = [f"rank {lost[0]}'s shard was not written"]
        if not errors:
            try:
                manifest = {**self.manifest, "crc32": crc32,
                            **({"node_files": files} if files else {})}
                write_synced(self.tmp / "manifest.json", json.dumps(manifest, indent=1))
                return ["ok", str(publish(self.tmp, self.root, self.step, self.keep,
                                          prune_later=self.in_background))]
            except Exception as e:  # noqa: BLE001 - reported to every rank, see below
                errors = [f"rank 0, publishing: {_what(e)}"]
        shutil.rmtree(self.tmp, ignore_errors=True)
        return ["error", save_failed(self.step, errors[0])]


def save_failed(step: int, why: str) -> str:
    return (f"saving checkpoint step {step} failed: {why}; the previous checkpoint is "
            "intact (check disk space and permissions of --train.out_dir)")


def _what(e: BaseException) -> str:
    """An exception for a one-line message: OSError's text names the errno and file;
    anything else (h5py's RuntimeError, a bug) also needs its type."""
    text = " ".join(str(e).split())
    return text if isinstance(e, OSError) and text else f"{type(e).__name__}: {text}"


def begin_save(root: Path, step: int, engine: GradEngine, grid: ProcessGrid, *, run: dict,
               keep: int, buffers: HostBuffers | None = None) -> PendingSave:
    """Start writing ``root/step_<step>`` from what ``engine`` holds (collective);
    ``.finish()`` completes it. ``run`` holds the manifest's ``config``, ``model`` (shape)
    and ``tokenizer``. With a pipeline every stage writes its own parameters. With
    ``buffers`` the save is asynchronous: the state is copied into them and written by a
    thread, unless the copy would not fit in host memory on some rank (then every rank
    saves synchronously and ``note`` says why). Whoever wrote into ``buffers`` before
    must have finished: they are overwritten here. The config's ``train.ckpt_files``
    (``node``) writes a file per node instead of per rank (never with ``buffers``)."""
    world = grid.world
    state = engine.state_shards()
    split = engine.tensor_split
    if state.kind == "replicated":
        index, sources = _replicated_shard(state, split, writes=grid.dp_world.rank == 0,
                                           writes_experts=grid.expert_world.rank == 0)
    else:
        index, sources = _zero_shard(state, grid, split)
    if grid.pp > 1 or grid.tp > 1 or grid.ep > 1:
        index = _merge_stage_indexes(world, grid, state.kind, index,
                                     f"checkpoint index of every stage (step {step})")
    sources["rng/torch"] = torch.get_rng_state()
    note = _no_room(world, buffers, sources, step) if buffers is not None else ""
    if buffers is not None and not note:  # training goes on and changes the tensors
        datasets, ready = buffers.copy(sources), buffers.ready
    else:
        datasets, ready = {k: _to_numpy(t) for k, t in sources.items()}, None
    made = _make_temporary(root, step) if world.is_root else None
    status, tmp = bcast_json(world.comm, made, timeout=world.timeout,
                             what=f"checkpoint save (step {step})")
    if status != "ok":
        raise CheckpointError(tmp)
    tmp = Path(tmp)
    config = run["config"]
    manifest = {"format": FORMAT, "version": VERSION, "step": step,
                "optimizer_step": state.step, "layout": state.kind, "world_size": world.size,
                "tensor_parallel": grid.tp, "expert_parallel": grid.ep,
                "model": run["model"], "config": config, "tokenizer": run.get("tokenizer"),
                "data": {"sampler": config["data"]["sampler"],
                         "seed": config["train"]["seed"], "next_step": step},
                "index": index}
    files = config["train"].get("ckpt_files", "rank")
    return PendingSave(root, step, tmp, world, datasets, manifest, keep, ready, note, files)


def _no_room(world: World, buffers: HostBuffers, sources: dict, step: int) -> str:
    """Whether every rank's copy fits in its node's memory (collective): '' when it does,
    else the warning that the save falls back to synchronous."""
    need = copy_bytes(sources)
    short, most = allreduce_array(
        world.comm, [int(not buffers.fits(sources, world.local_size, available_bytes())), need],
        op=MPI.MAX, timeout=world.timeout, what=f"checkpoint save (step {step}): host memory")
    if not short:
        return ""
    return (f"--train.ckpt_async: a copy of the state ({most / 2**30:.2f} GiB on the largest "
            f"rank) would not fit in a node's available host memory; saving synchronously "
            "(free memory, or run fewer ranks per node)")


def _make_temporary(root: Path, step: int) -> list[str]:
    """Rank 0 picks the directory every rank writes into: ``["ok", path]``, or
    ``["error", message]`` when it cannot be made (every rank raises it)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        return ["ok", tempfile.mkdtemp(prefix=f".step_{step:06d}.", suffix=".tmp", dir=root)]
    except OSError as e:
        return ["error", save_failed(step, f"rank 0: {_what(e)}")]


def save_sharded(root: Path, step: int, engine: GradEngine, grid: ProcessGrid,
                 **kwargs) -> Path:
    """Write ``root/step_<step>`` from every rank's shard; returns its path (collective)."""
    return begin_save(root, step, engine, grid, **kwargs).finish()


def load_sharded(path: str | Path, engine: GradEngine, grid: ProcessGrid, *,
                 model_shape: dict) -> int:
    """Load the checkpoint at ``path`` into this run's layout; returns its step. With a
    pipeline, each stage takes its own parameters (the caller re-ties the embedding)."""
    world = grid.world
    manifest = read_manifest(path)
    check_compatible(manifest, model_shape)
    opt_step = float(manifest.data["optimizer_step"])
    state = engine.state_shards()
    if _same_zero_layout(manifest, state, grid, engine.tensor_split):
        engine.load_shards(read_own_shards(manifest, world.rank), opt_step)
    else:
        _load_resharded(manifest, engine, opt_step)
    if manifest.world_size == world.size:  # same ranks: continue each rank's RNG stream
        torch.set_rng_state(read_rng(manifest, world.rank))
    return manifest.step


def _same_zero_layout(manifest, state, grid: ProcessGrid, split: TensorSplit) -> bool:
    """True when the checkpoint's buckets and shards on this rank are exactly this
    engine's."""
    data, world = manifest.data, grid.world
    if state.kind != "zero" or data["layout"] != "zero" or manifest.world_size != world.size:
        return False
    theirs = [b for b in data["index"]["buckets"] if world.rank in bucket_ranks(manifest, b)]
    return _zero_index(state, grid, split)["buckets"] == theirs


def _load_resharded(manifest, engine: GradEngine, opt_step: float) -> None:
    """Any layout into any layout: rebuild whole tensors, take this run's part."""
    full = read_full_state(manifest)
    model = engine.model
    missing = {n for n, _ in model.named_parameters()} - set(full)
    if missing:
        raise CheckpointError(f"checkpoint {manifest.path} lacks {sorted(missing)[:3]}; it "
                              "was made for another model")
    whole = {n: engine.tensor_split.whole_shape(n, p.shape) for n, p in model.named_parameters()}
    wrong = [f"{n} {list(full[n]['param'].shape)} (yours {list(shape)})"
             for n, shape in whole.items() if tuple(full[n]["param"].shape) != shape]
    if wrong:  # the model keys agree, so the index is damaged
        raise CheckpointError(f"checkpoint {manifest.path}: the manifest's shapes differ "
                              f"from the model's: {', '.join(wrong[:3])}; the checkpoint is "
                              "damaged: resume from an older step_N directory")
    engine.load_full_state(full, opt_step)


def find_resume(resume: str, out_dir: Path) -> Path | None:
    """``--train.resume``: '' = start fresh; 'auto' = this out_dir's latest checkpoint if
    there is one; anything else is a checkpoint path that must exist."""
    if not resume:
        return None
    if resume == "auto":
        latest = out_dir / "checkpoints" / "latest"
        return out_dir / "checkpoints" if latest.is_file() else None
    p = Path(resume)
    if not p.exists():
        raise CheckpointError(f"--train.resume={resume}: no such checkpoint; pass a "
                              "checkpoints/step_N directory, a run's out_dir, or 'auto'")
    return p
