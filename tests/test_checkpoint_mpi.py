"""Sharded checkpoints over real MPI ranks: exact resume, and resharding across world
sizes and ZeRO levels (a sub-communicator plays the smaller job)."""

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.checkpoint.sharded import read_manifest
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _cfg(data, out, **overrides):
    return tiny_config(data, out, **{"train.ckpt_interval": 5, "train.save_checkpoint": True,
                                     "parallel.bucket_mb": 0.02,
                                     "parallel.first_bucket_mb": 0.005, **overrides})


def _fit(cfg, comm=COMM):
    trainer = Trainer(cfg, cpu_world(comm), verbose=False)
    return trainer.fit()


@pytest.mark.parametrize("zero", [0, 3])
def test_resume_at_the_same_world_size_is_bitwise_identical(mpi_dataset, shared_tmp, zero):
    full = _fit(_cfg(mpi_dataset, f"{shared_tmp}/a", **{"parallel.zero": zero}))
    step5 = f"{shared_tmp}/a/checkpoints/step_000005"
    assert read_manifest(step5).world_size == COMM.size
    resumed = _fit(_cfg(mpi_dataset, f"{shared_tmp}/b", **{"parallel.zero": zero,
                                                           "train.resume": step5}))
    assert len(resumed.losses) == 5 and resumed.losses == full.losses[5:]


@pytest.mark.parametrize("big_zero,small_zero,small_size", [(3, 0, 1), (0, 3, 2), (2, 1, 2)])
def test_reshard_between_world_sizes_and_stages(mpi_dataset, shared_tmp, big_zero, small_zero,
                                                small_size):
    """A checkpoint of every rank of this job resumes on ``small_size`` of them (a
    sub-communicator) at another ZeRO level, and a checkpoint of the small job resumes on
    every rank: the losses continue the uninterrupted run's to fp32 round-off."""
    big = _fit(_cfg(mpi_dataset, f"{shared_tmp}/big", **{"parallel.zero": big_zero}))
    sub = COMM.Split(color=int(COMM.rank < small_size), key=COMM.rank)
    if COMM.rank < small_size:
        shrunk = _fit(_cfg(mpi_dataset, f"{shared_tmp}/shrunk", **{
            "parallel.zero": small_zero,
            "train.resume": f"{shared_tmp}/big/checkpoints/step_000005"}), sub)
        np.testing.assert_allclose(shrunk.losses, big.losses[5:], atol=1e-5, rtol=0)
        small = _fit(_cfg(mpi_dataset, f"{shared_tmp}/small", **{"parallel.zero": small_zero}),
                     sub)
        np.testing.assert_allclose(small.losses, big.losses, atol=1e-5, rtol=0)
    sub.Free()
    COMM.Barrier()
    assert read_manifest(f"{shared_tmp}/small/checkpoints/step_000005").world_size == small_size
    grown = _fit(_cfg(mpi_dataset, f"{shared_tmp}/grown", **{
        "parallel.zero": big_zero, "train.resume": f"{shared_tmp}/small/checkpoints/step_000005"}))
    np.testing.assert_allclose(grown.losses, big.losses[5:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("zero", [0, 2])
def test_a_save_failing_on_one_rank_is_one_clean_error_on_every_rank(mpi_dataset, shared_tmp,
                                                                     monkeypatch, zero):
    """Rank 1's shard write fails (h5py reports a full disk as RuntimeError): every rank
    raises the same CheckpointError, none is left waiting, and the previous checkpoint,
    ``latest`` and no temporary remain."""
    import hpctrain.checkpoint.distributed as distributed
    from hpctrain.checkpoint.sharded import CheckpointError

    out = Path(shared_tmp) / "run"
    trainer = Trainer(_cfg(mpi_dataset, out, **{"parallel.zero": zero,
                                                "train.max_iters": 10}),
                      cpu_world(COMM), verbose=False)
    trainer.fit()
    real = distributed.write_shard

    def full_disk_on_rank_1(*args, **kwargs):
        if COMM.rank == 1:
            raise RuntimeError("Can't write data (file write failed: No space left)")
        return real(*args, **kwargs)

    monkeypatch.setattr(distributed, "write_shard", full_disk_on_rank_1)
    with pytest.raises(CheckpointError, match="step 15 failed: rank 1: RuntimeError: Can't "
                                              "write data") as e:
        trainer.saver.save(15)
    assert "\n" not in str(e.value)
    COMM.Barrier()
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000010"
    assert read_manifest(out).step == 10
    assert not list(root.glob(".step_*")) and not (root / "step_000015").exists()


def test_resume_from_an_older_step_keeps_it_and_moves_the_newer_aside(mpi_dataset,
                                                                      shared_tmp):
    """At 2 ranks: rank 0 moves the newer checkpoints aside while every rank waits for
    its verdict; the resume source survives the resumed run's pruning (keep 2)."""
    out = Path(shared_tmp) / "rollback"
    _fit(_cfg(mpi_dataset, out, **{"train.ckpt_keep": 2}))  # saves 5 and 10
    root = out / "checkpoints"
    resumed = _fit(_cfg(mpi_dataset, out, **{"train.ckpt_keep": 2, "train.max_iters": 8,
                                             "train.resume": str(root / "step_000005")}))
    COMM.Barrier()
    assert len(resumed.losses) == 3
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000005", "step_000008"]
    assert [p.name for p in out.glob("previous-*/checkpoints/*")] == ["step_000010"]
