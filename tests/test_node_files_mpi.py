"""``--train.ckpt_files=node`` over real MPI ranks, on nodes simulated by
``HPCTRAIN_TEST_RANKS_PER_NODE``: one file per node, and every reader (resume at the
same and at smaller world sizes, inspect --verify, merge, reshard) gets from it exactly
what it gets from the same run's rank files."""

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint.ckpt_commands import export, inspect, merge, reshard
from hpctrain.checkpoint.sharded import read_full_state, read_manifest
from hpctrain.comm.world import RANKS_PER_NODE_ENV
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config, two_ranks_suffice

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
STEP5 = "checkpoints/step_000005"
ONE_PER_NODE = two_ranks_suffice("nodes of one rank each: every rank writes its own file "
                                 "at any world size")


def _fit(data, out, comm=COMM, **overrides):
    cfg = tiny_config(data, out, **{"train.ckpt_interval": 5, "train.save_checkpoint": True,
                                    "parallel.bucket_mb": 0.02,
                                    "parallel.first_bucket_mb": 0.005, **overrides})
    return Trainer(cfg, cpu_world(comm), verbose=False).fit()


def _resumed_on(size: int, data, out, **overrides):
    """The losses of a resume on the first ``size`` ranks (None on the others)."""
    sub = COMM.Split(color=int(COMM.rank < size), key=COMM.rank)
    losses = _fit(data, out, sub, **overrides).losses if COMM.rank < size else None
    sub.Free()
    return losses


DP_AT_TWO = two_ranks_suffice("the node writer gathers whatever each rank's shard holds; "
                              "ZeRO-3 runs the 4-rank, two-node case")


@pytest.mark.parametrize("zero,per_node,smaller", [
    (3, 2, (1, 2)), pytest.param(0, 2, (1,), marks=DP_AT_TWO),
    pytest.param(3, 1, (), marks=ONE_PER_NODE)])
def test_node_files_resume_at_every_size_as_rank_files_do(mpi_dataset, shared_tmp, monkeypatch,
                                                          zero, per_node, smaller):
    """A file per simulated node; the same losses as rank files; a resume at this world
    size continues bit for bit, one at ``smaller`` sizes as the rank files' does."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, str(per_node))
    tmp = Path(shared_tmp)
    by_rank = _fit(mpi_dataset, tmp / "rank", **{"parallel.zero": zero})
    by_node = _fit(mpi_dataset, tmp / "node", **{"parallel.zero": zero,
                                                 "train.ckpt_files": "node"})
    assert by_node.losses == by_rank.losses
    step5 = tmp / "node" / STEP5
    nodes = math.ceil(COMM.size / per_node)
    assert sorted(p.name for p in step5.glob("*.h5")) == [f"node_{n:05d}.h5"
                                                         for n in range(nodes)]
    assert read_manifest(step5).data["node_files"] == {
        f"node_{n:05d}.h5": list(range(n * per_node, min(COMM.size, (n + 1) * per_node)))
        for n in range(nodes)}
    again = _fit(mpi_dataset, tmp / "again", **{"parallel.zero": zero,
                                                "train.resume": str(step5)})
    assert again.losses == by_rank.losses[5:]  # same world size: bit for bit
    for size in [s for s in smaller if s < COMM.size]:
        kw = {"parallel.zero": zero}
        from_node = _resumed_on(size, mpi_dataset, tmp / f"n{size}",
                                **kw, **{"train.resume": str(step5)})
        from_rank = _resumed_on(size, mpi_dataset, tmp / f"r{size}",
                                **kw, **{"train.resume": str(tmp / "rank" / STEP5)})
        assert from_node == from_rank
        assert COMM.rank >= size or len(from_node) == 5


@two_ranks_suffice("the tools read on one process; a two-rank node file is what they read")
def test_the_tools_read_node_files_as_rank_files(mpi_dataset, shared_tmp, monkeypatch):
    """inspect --verify, merge, export and reshard (single process, on rank 0) read a
    node-file checkpoint of this job into what they read from the same run's rank files."""
    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    tmp = Path(shared_tmp)
    for files in ("rank", "node"):
        _fit(mpi_dataset, tmp / files, **{"parallel.zero": 2, "train.max_iters": 5,
                                          "train.ckpt_files": files})
    if COMM.rank == 0:
        node, rank = tmp / "node" / STEP5, tmp / "rank" / STEP5
        text = inspect(node, verify=True)
        assert "verified" in text and "node_00000.h5" in text and "rank_00000" not in text
        full = {k: read_full_state(read_manifest(p)) for k, p in (("node", node),
                                                                   ("rank", rank))}
        for name, s in full["rank"].items():
            for k, t in s.items():
                assert np.array_equal(full["node"][name][k].numpy(), t.numpy()), (name, k)
        merge(node, tmp / "node.h5")
        merge(rank, tmp / "rank.h5")
        with h5py.File(tmp / "node.h5") as a, h5py.File(tmp / "rank.h5") as b:
            a.visititems(lambda n, d: isinstance(d, h5py.Dataset)
                         and np.testing.assert_array_equal(d[()], b[n][()]))
        export(node, "safetensors", tmp / "node.safetensors")
        export(rank, "safetensors", tmp / "rank.safetensors")
        assert (tmp / "node.safetensors").read_bytes() == (tmp / "rank.safetensors").read_bytes()
        out = reshard(node, tmp / "resharded", world=3, zero=3)
        assert "node_files" not in read_manifest(out).data
        assert sorted(p.name for p in out.glob("*.h5")) == [f"rank_{r:05d}.h5" for r in range(3)]
        inspect(out, verify=True)
    COMM.Barrier()


@pytest.mark.parametrize("failing", ["open", "mid-write"])
def test_a_node_writer_failing_is_one_clean_error_on_every_rank(mpi_dataset, shared_tmp,
                                                                monkeypatch, failing):
    """The writer fails before its file (a full disk at the reservation) or after its
    first group (a full disk while it writes the second rank's): every rank raises the
    same CheckpointError, none is left waiting, the previous checkpoint stays."""
    import hpctrain.checkpoint.node_files as node_files
    from hpctrain.checkpoint.sharded import CheckpointError

    monkeypatch.setenv(RANKS_PER_NODE_ENV, "2")
    out = Path(shared_tmp) / "run"
    trainer = Trainer(tiny_config(mpi_dataset, out, **{
        "train.save_checkpoint": True, "parallel.zero": 3, "train.ckpt_files": "node"}),
        cpu_world(COMM), verbose=False)
    trainer.fit()
    name = "reserve_space" if failing == "open" else "write_datasets"
    real, calls = getattr(node_files, name), []

    def full_disk(*args, **kwargs):
        calls.append(1)
        if len(calls) == (1 if failing == "open" else 2):
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(node_files, name, full_disk)
    with pytest.raises(CheckpointError, match="step 15 failed: rank 0: .*No space left"):
        trainer.saver.save(15)
    COMM.Barrier()
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000010"
    assert not list(root.glob(".step_*")) and not (root / "step_000015").exists()
    assert read_manifest(out).data["node_files"]
