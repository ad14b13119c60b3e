"""Check a sharded checkpoint's manifest before anything uses it.

A manifest that is valid JSON may still be damaged by hand or crafted: a key missing, a
shape of the wrong type, a world size of a billion, offsets past the end of a bucket.
Used as is, that becomes a KeyError or TypeError traceback deep in a load, or a huge
allocation. ``validate_manifest`` checks types, required keys and bounds up front and
turns the first problem into one ``CheckpointError`` that names the file, the key and
the fix. It checks the manifest against itself only; the shards are checked against the
manifest when they are read (``sharded._read``), the model when it is loaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hpctrain.checkpoint.format import MODEL_KEYS, NODE_FILE_NAME, shard_name
from hpctrain.model.shape import GPTConfig
from hpctrain.sizes import MAX_ELEMENTS, MAX_WORLD, finite, show_value, whole

MODEL_TYPES = {f.name: str(f.type) for f in dataclasses.fields(GPTConfig)}
"""Each model key's type ('int', 'float', 'str', 'bool'; annotations are strings)."""

MAX_DIMS = 32
LAYOUTS = ("replicated", "zero")


class Damaged(Exception):
    """One problem, with where it is in the manifest (``index.buckets[0].offsets``)."""


def validate_manifest(data) -> None:
    """Raise ``Damaged`` naming the first problem of the manifest ``data`` (parsed JSON)."""
    top = _dict(data, "the manifest")
    _int(_key(top, "step"), "step", 0, 1 << 62)
    _number(_key(top, "optimizer_step"), "optimizer_step")
    layout = _key(top, "layout")
    if layout not in LAYOUTS:
        raise Damaged(f"layout is {show_value(layout)}, not one of {', '.join(LAYOUTS)}")
    world = _int(_key(top, "world_size"), "world_size", 1, MAX_WORLD)
    tp = _int(top.get("tensor_parallel", 1), "tensor_parallel", 1, world)
    if world % tp:
        raise Damaged(f"tensor_parallel is {tp}, which does not divide world_size {world}")
    _model(_dict(_key(top, "model"), "model"))
    _dict(_key(top, "config"), "config")
    if top.get("tokenizer") is not None:
        _dict(top["tokenizer"], "tokenizer")
    index = _dict(_key(top, "index"), "index")
    if layout == "replicated":
        _replicated_index(index, world)
    else:
        _zero_index(index, world)
    _crc32(_dict(_key(top, "crc32"), "crc32"), world)
    if top.get("node_files") is not None:
        _node_files(_dict(top["node_files"], "node_files"), world)


def _model(model: dict) -> None:
    """Each key by the type of its ``GPTConfig`` field, then the shape's own checks."""
    for k in MODEL_KEYS:
        v = _key(model, k, "model")
        kind = MODEL_TYPES[k]
        if kind == "bool":
            if not isinstance(v, bool):
                raise Damaged(f"model.{k} is {show_value(v)}, not true or false")
        elif kind == "str":
            if not isinstance(v, str) or len(v) > 200:
                raise Damaged(f"model.{k} is {show_value(v)}, not a short string")
        elif kind == "float":
            if _number(v, f"model.{k}") <= 0:
                raise Damaged(f"model.{k} is {show_value(v)}, not a number > 0")
        else:  # the lower bound of each size is SIZE_LIMITS' (moe_experts may be 0)
            _int(v, f"model.{k}", 0, MAX_ELEMENTS)
    try:  # each size within its own limit (model.shape.SIZE_LIMITS)
        GPTConfig.from_shape(model)
    except ValueError as e:
        raise Damaged(f"model: {e}") from None


def _replicated_index(index: dict, world: int) -> None:
    params = _dict(_key(index, "params", "index"), "index.params")
    if not params:
        raise Damaged("index.params is empty")
    total = 0
    for name, shape in params.items():
        total += _shape(shape, f"index.params[{name!r}]")
    _bounded(total, "the parameters of index.params")
    owners = _dict(index.get("owners", {}), "index.owners")
    for name, rank in owners.items():
        _int(rank, f"index.owners[{name!r}]", 0, world - 1)


def _zero_index(index: dict, world: int) -> None:
    buckets = _list(_key(index, "buckets", "index"), "index.buckets")
    if not buckets:
        raise Damaged("index.buckets is empty")
    total = 0
    for i, b in enumerate(buckets):
        total += _bucket(_dict(b, f"index.buckets[{i}]"), f"index.buckets[{i}]", world)
    _bounded(total, "the buckets of index.buckets")


def _bucket(b: dict, where: str, world: int) -> int:
    """Check one ZeRO bucket: its tensors lie back to back from offset 0 (as
    ``shard_layout`` puts them, so a changed shape shows as a wrong offset), inside the
    flat buffer that its holders' shards make up (``read_full_state`` slices it there).
    Returns the buffer's length."""
    names = _list(_key(b, "names", where), f"{where}.names")
    shapes = _list(_key(b, "shapes", where), f"{where}.shapes")
    offsets = _list(_key(b, "offsets", where), f"{where}.offsets")
    if not len(names) == len(shapes) == len(offsets):
        raise Damaged(f"{where} lists {len(names)} names, {len(shapes)} shapes and "
                      f"{len(offsets)} offsets; they must be as many")
    shard = _int(_key(b, "shard", where), f"{where}.shard", 1, MAX_ELEMENTS)
    _int(_key(b, "world", where), f"{where}.world", 1, MAX_WORLD)
    holders = _ranks(b.get("ranks"), f"{where}.ranks", world)
    if "key" in b and not (isinstance(b["key"], str) and b["key"]):
        raise Damaged(f"{where}.key is {show_value(b['key'])}, not a dataset name")
    buffer = _bounded(shard * holders, f"{where}: shard x ranks")
    end = 0
    for j, (name, shape, off) in enumerate(zip(names, shapes, offsets)):
        if not isinstance(name, str):
            raise Damaged(f"{where}.names[{j}] is {show_value(name)}, not a parameter name")
        n = _shape(shape, f"{where}.shapes[{j}]")
        if type(off) is not int or off != end:
            raise Damaged(f"{where}.offsets[{j}] is {show_value(off)}, but the tensors before "
                          f"{name} end at {end}: offsets and shapes disagree")
        end += n
        if end > buffer:
            raise Damaged(f"{where}: {name} ({n} elements at offset {off}) ends past the "
                          f"bucket's {buffer} elements (shard {shard} x {holders} ranks)")
    return buffer


def _ranks(ranks, where: str, world: int) -> int:
    """How many ranks hold a bucket: its ``ranks`` (distinct, each < world_size), or all."""
    if ranks is None:
        return world
    _list(ranks, where)
    for r in ranks:
        _int(r, f"{where} entry", 0, world - 1)
    if not ranks or len(set(ranks)) != len(ranks):
        raise Damaged(f"{where} is {show_value(ranks)}: it must list distinct ranks, at least one")
    return len(ranks)


def _crc32(crc32: dict, world: int) -> None:
    for r in range(world):
        name = shard_name(r)
        table = _dict(_key(crc32, name, "crc32"), f"crc32[{name!r}]")
        for ds, crc in table.items():
            _int(crc, f"crc32[{name!r}][{ds!r}]", 0, 0xFFFFFFFF)


def _node_files(files: dict, world: int) -> None:
    """Node files (``format.shard_locations``): plain ``node_N.h5`` names, and every rank
    of the checkpoint in exactly one of them."""
    seen: set[int] = set()
    for name, ranks in files.items():
        if not NODE_FILE_NAME.fullmatch(name):
            raise Damaged(f"node_files names {show_value(name)}, not a file like node_00000.h5")
        for r in _list(ranks, f"node_files[{name!r}]"):
            _int(r, f"node_files[{name!r}] entry", 0, world - 1)
            if r in seen:
                raise Damaged(f"node_files lists rank {r} twice")
            seen.add(r)
    if len(seen) != world:
        missing = min(set(range(world)) - seen)
        raise Damaged(f"node_files lists no file for rank {missing} of {world}")


# ------------------------------------------------------------------------ primitives

def _key(d: dict, key: str, where: str = ""):
    if key not in d:
        raise Damaged(f"{where + '.' if where else ''}{key} is missing")
    return d[key]


def _dict(v, where: str) -> dict:
    if not isinstance(v, dict):
        raise Damaged(f"{where} is {show_value(v)}, not a JSON object")
    return v


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise Damaged(f"{where} is {show_value(v)}, not a list")
    return v


def _int(v, where: str, lo: int, hi: int) -> int:
    return whole(v, where, lo, hi, error=Damaged)


def _number(v, where: str) -> float:
    return finite(v, where, 0.0, error=Damaged)


def _shape(shape, where: str) -> int:
    """Check a tensor shape (a list of at most MAX_DIMS sizes >= 0); return its elements."""
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise Damaged(f"{where} is {show_value(shape)}, not a shape (a list of sizes)")
    n = 1
    for d in shape:
        _int(d, f"{where} size", 0, MAX_ELEMENTS)
        n *= d
    return _bounded(n, where)


def _bounded(n: int, what: str) -> int:
    if n >= MAX_ELEMENTS:
        raise Damaged(f"{what} has {n} elements, more than any checkpoint holds "
                      f"(limit {MAX_ELEMENTS})")
    return n


def describe(path: Path, problem: Damaged) -> str:
    return f"{path} is damaged: {problem}; resume from an older step_N directory"
