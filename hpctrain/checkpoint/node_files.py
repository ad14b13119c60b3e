"""One checkpoint file per node (``--train.ckpt_files=node``): the ranks of a node hand
their shards to the node's first rank over the node communicator, which writes them as
one group per rank (``rank_00003/...``, the datasets and CRC-32s of a rank file) into
``node_<N>.h5``. At 10,000 ranks that is a file per node instead of per rank: the
metadata servers see a quarter to a twelfth of the creates. ``format.shard_locations``
is how readers find a shard; docs/design/checkpoints.md, "Node files".

The writer holds its own shard and one other at a time: the others' arrays arrive one
rank after another, each written before the next is received. Collective over the
node's ranks (``World.local_comm``), on the main thread (the asynchronous save's writer
thread makes no MPI call, so the two are not combined: ``TrainConfig``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from hpctrain.atomic import h5_bytes, reserve_space
from hpctrain.checkpoint.format import node_file_name, shard_group, shard_name
from hpctrain.checkpoint.sharded import write_datasets
from hpctrain.comm.small_collectives import bcast_json, gather_json
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import World

TAG = 43
PIECE_ELEMENTS = 1 << 28
"""Arrays travel in messages of at most this many elements (MPI counts are 32-bit)."""


def write_node_file(world: World, directory: Path, datasets: dict[str, np.ndarray],
                    attrs: dict) -> tuple[dict[str, dict[str, int]], dict[str, list[int]]]:
    """Write this node's ranks' shards into ``directory/node_<N>.h5`` (collective over
    the node). Returns, on the node's first rank, each of its ranks' CRC-32s by shard
    name and ``{file name: [ranks]}``; on the others two empty dicts. A failure of the
    writer raises there, after every rank of the node has handed over its shard (no
    rank is left waiting); a rank that cannot send raises on that rank."""
    comm, what = world.local_comm, f"checkpoint save (step {attrs['step']}): node file"
    arrays = {k: np.ascontiguousarray(a) for k, a in datasets.items()}
    header = [world.rank, [[k, a.dtype.str, list(a.shape)] for k, a in arrays.items()]]
    headers = gather_json(comm, header, timeout=world.timeout, what=what)
    name = node_file_name(world.node)
    opened = _open(directory / name, headers, attrs) if world.local_rank == 0 else None
    go = bcast_json(comm, None if opened is None or isinstance(opened, str) else "go",
                    timeout=world.timeout, what=what)
    if world.local_rank != 0:
        if go:
            wait_all([r for a in arrays.values() for r in _pieces(comm.Isend, a, 0)],
                     timeout=world.timeout, what=what)
        return {}, {}
    if isinstance(opened, str):
        raise OSError(opened)
    return _write_all(world, opened, arrays, headers, attrs), {name: [r for r, _ in headers]}


def _open(path: Path, headers: list, attrs: dict):
    """The node file, open for writing after its room is made sure of, or why not."""
    import h5py

    sizes = [np.dtype(dt).itemsize * int(np.prod(shape))
             for _, fields in headers for _, dt, shape in fields]
    try:
        reserve_space(path.parent, h5_bytes(sizes))
        f = h5py.File(path, "w")
        f.attrs.update({k: v for k, v in attrs.items() if k != "rank"})
        return f
    except Exception as e:  # noqa: BLE001 - reported by the caller as the save's failure
        return f"{path}: {e}"


def _write_all(world: World, f, mine: dict, headers: list, attrs: dict) -> dict:
    """The writer: its own group, then each other rank's as it arrives. After a write
    fails the rest is still received (the senders wait for it), then the error raised."""
    crcs, error = {}, None
    try:
        with f:
            for src, (rank, fields) in enumerate(headers):
                arrays = mine if src == 0 else _receive(world, src, fields, attrs["step"])
                if error is None:
                    try:
                        g = f.create_group(shard_group(rank))
                        g.attrs.update({**attrs, "rank": rank})
                        crcs[shard_name(rank)] = write_datasets(g, arrays)
                    except Exception as e:  # noqa: BLE001 - raised once all is received
                        error = e
                del arrays
            f.flush()
            os.fsync(f.id.get_vfd_handle())
    except Exception as e:  # noqa: BLE001 - closing can fail too
        error = error or e
    if error is not None:
        raise error
    return crcs


def _receive(world: World, src: int, fields: list, step: int) -> dict[str, np.ndarray]:
    arrays = {k: np.empty(shape, dtype=np.dtype(dt)) for k, dt, shape in fields}
    wait_all([r for a in arrays.values() for r in _pieces(world.local_comm.Irecv, a, src)],
             timeout=world.timeout,
             what=f"checkpoint save (step {step}): node file, from rank {src} of the node")
    return arrays


def _pieces(call, a: np.ndarray, peer: int) -> list:
    """``call`` (Isend or Irecv) on ``a`` in pieces of at most PIECE_ELEMENTS, in order
    (messages between two ranks with one tag arrive in the order they were sent)."""
    flat = a.reshape(-1)
    return [call(flat[lo:lo + PIECE_ELEMENTS], peer, TAG)
            for lo in range(0, flat.size, PIECE_ELEMENTS)]
