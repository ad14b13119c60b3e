"""Asynchronous checkpoints over real MPI ranks under DP, ZeRO-3, pp=2 and tp=2: each
write held until a training step has run on its rank, the checkpoints the synchronous
run's byte for byte, and a resume from one bit for bit (one process, the planted
bugs: test_async_checkpoint.py). pp=2 and tp=2 are ``slow``: make test-openmpi."""

import threading
import time
from pathlib import Path

import pytest
from mpi4py import MPI

import hpctrain.checkpoint.distributed as distributed
from hpctrain.train.trainer import Trainer
from tests.checkpoint_content import assert_same_checkpoints
from tests.helpers import cpu_world, tiny_config

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
SLOW = pytest.mark.slow  # make test-openmpi runs them, at 2 and 4 ranks
LAYOUTS = [pytest.param({"parallel.zero": 0}, id="dp"),
           pytest.param({"parallel.zero": 3}, id="zero3"),
           pytest.param({"parallel.pp": 2, "parallel.micro_batches": 2}, id="pp2", marks=SLOW),
           pytest.param({"parallel.tp": 2, "parallel.zero": 1, "model.vocab_multiple": 8},
                        id="tp2", marks=SLOW)]


def _fit(data, out, trainer_hook=None, **overrides):
    cfg = tiny_config(data, out, **{"train.ckpt_interval": 2, "train.ckpt_keep": 0,
                                    "train.max_iters": 6, "train.save_checkpoint": True,
                                    "parallel.bucket_mb": 0.02,
                                    "parallel.first_bucket_mb": 0.005, **overrides})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    if trainer_hook is not None:
        trainer_hook(trainer)
    return trainer, trainer.fit()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_checkpoints_are_the_sync_ones_and_resume_exactly(mpi_dataset, shared_tmp,
                                                                 monkeypatch, layout):
    _, full = _fit(mpi_dataset, f"{shared_tmp}/sync", **layout)
    real = distributed.write_shard
    holder = {}

    def held_write(path, datasets, attrs, **kwargs):  # a step runs first, on this rank
        if threading.current_thread() is not threading.main_thread():
            for _ in range(6000):  # bounded (60 s): a hang fails here
                if holder["saver"].overlapped.get(attrs["step"], 0) >= 1:
                    break
                time.sleep(0.01)
        return real(path, datasets, attrs, **kwargs)

    monkeypatch.setattr(distributed, "write_shard", held_write)
    trainer, result = _fit(mpi_dataset, f"{shared_tmp}/async",
                           lambda t: holder.update(saver=t.saver),
                           **{"train.ckpt_async": True, **layout})
    monkeypatch.setattr(distributed, "write_shard", real)
    assert result.losses == full.losses
    assert sorted(trainer.saver.overlapped) == [2, 4]
    assert min(trainer.saver.overlapped.values()) >= 1
    COMM.Barrier()
    if COMM.rank == 0:
        assert_same_checkpoints(Path(shared_tmp) / "async/checkpoints",
                                Path(shared_tmp) / "sync/checkpoints")
    _, resumed = _fit(mpi_dataset, f"{shared_tmp}/resumed", **{
        "train.resume": f"{shared_tmp}/async/checkpoints/step_000004", **layout})
    assert resumed.losses == full.losses[4:]
