"""Sharded checkpoints in one process: exact resume, resharding between ZeRO levels,
atomic saves, pruning, every bad-input case, and the non-finite guard."""

import json
import shutil

import h5py
import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpctrain.checkpoint.distributed as distributed
from hpctrain.checkpoint.sharded import CheckpointError, read_manifest, shard_name
from hpctrain.errors import NonFiniteError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config


def _cfg(data, out, **overrides):
    return tiny_config(data, out, **{"train.ckpt_interval": 10, "train.save_checkpoint": True,
                                     "train.max_iters": 20,
                                     **overrides})


def _fit(cfg):
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    return trainer, trainer.fit()


@pytest.mark.parametrize("zero,dtype,dropout", [(0, "fp32", 0.0), (2, "fp32", 0.0),
                                               (3, "fp32", 0.0), (1, "bf16", 0.0),
                                               (0, "fp32", 0.2)])
def test_resume_with_the_same_layout_is_bitwise_identical(dataset_path, tmp_path, zero, dtype,
                                                          dropout):
    """With dropout the masks come from torch's random stream: the checkpoint's RNG
    state must be restored for the resumed steps to draw the uninterrupted run's masks."""
    over = {"parallel.zero": zero, "train.dtype": dtype, "model.dropout": dropout}
    _, full = _fit(_cfg(dataset_path, tmp_path / "a", **over))
    step10 = tmp_path / "a" / "checkpoints" / "step_000010"
    assert (tmp_path / "a" / "checkpoints" / "latest").read_text().strip() == "step_000020"
    _, resumed = _fit(_cfg(dataset_path, tmp_path / "b", **over, **{"train.resume": str(step10)}))
    assert len(resumed.losses) == 10
    assert resumed.losses == full.losses[10:]  # exactly: same bits, not just close


def test_async_saves_and_odd_intervals_resume_exactly(dataset_path, tmp_path):
    over = {"train.ckpt_async": True, "train.ckpt_interval": 7, "parallel.zero": 1}
    _, full = _fit(_cfg(dataset_path, tmp_path / "a", **over))
    root = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000007", "step_000014",
                                                           "step_000020"]
    _, resumed = _fit(_cfg(dataset_path, tmp_path / "b", **over,
                           **{"train.resume": str(root / "step_000014")}))
    assert resumed.losses == full.losses[14:]


@pytest.mark.parametrize("save_zero,load_zero", [(3, 0), (0, 3), (1, 2)])
def test_resume_into_another_zero_stage(dataset_path, tmp_path, save_zero, load_zero):
    _, full = _fit(_cfg(dataset_path, tmp_path / "a", **{"parallel.zero": save_zero}))
    step10 = tmp_path / "a" / "checkpoints" / "step_000010"
    _, resumed = _fit(_cfg(dataset_path, tmp_path / "b", **{"parallel.zero": load_zero,
                                                             "train.resume": str(step10)}))
    np.testing.assert_allclose(resumed.losses, full.losses[10:], atol=1e-5, rtol=0)


def test_auto_resume_continues_the_run_and_appends_metrics(dataset_path, tmp_path):
    _fit(_cfg(dataset_path, tmp_path, **{"train.max_iters": 10}))
    trainer, result = _fit(_cfg(dataset_path, tmp_path, **{"train.max_iters": 20,
                                                           "train.resume": "auto"}))
    assert trainer.start.step == 10 and len(result.losses) == 10
    steps = [json.loads(x).get("step") for x in (tmp_path / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps[:2] == [5, 10] and 20 in steps
    # auto with nothing to resume starts fresh
    trainer, _ = _fit(_cfg(dataset_path, tmp_path / "fresh", **{"train.resume": "auto"}))
    assert trainer.start.step == 0


def test_keeps_the_last_k_and_latest_names_the_newest(dataset_path, tmp_path):
    _fit(_cfg(dataset_path, tmp_path, **{"train.ckpt_interval": 5, "train.ckpt_keep": 2}))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == \
        ["latest", "step_000015", "step_000020"]
    assert (root / "latest").read_text().strip() == "step_000020"


def test_a_crash_during_save_leaves_the_previous_checkpoint(dataset_path, tmp_path, monkeypatch):
    trainer, _ = _fit(_cfg(dataset_path, tmp_path, **{"train.max_iters": 10}))

    def crash(*args, **kwargs):
        raise RuntimeError("node lost power")

    monkeypatch.setattr(distributed, "publish", crash)
    with pytest.raises(CheckpointError, match="node lost power"):
        trainer.saver.save(15)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000010"
    assert read_manifest(tmp_path).step == 10  # still complete and loadable
    assert not (root / "step_000015").exists()
    assert not list(root.glob(".step_*"))  # the temporary is gone too


def _damaged(tmp_path, dataset_path):
    _fit(_cfg(dataset_path, tmp_path / "run", **{"parallel.zero": 2}))
    ckpt = tmp_path / "run" / "checkpoints" / "step_000020"
    return ckpt, _cfg(dataset_path, tmp_path / "again", **{"train.resume": str(ckpt)})


def test_corrupt_truncated_and_missing_shards_are_refused(dataset_path, tmp_path):
    ckpt, cfg = _damaged(tmp_path, dataset_path)
    shard = ckpt / shard_name(0)
    backup = tmp_path / "backup.h5"
    shutil.copy(shard, backup)
    with h5py.File(shard, "r+") as f:  # one value changed, manifest untouched
        f["bucket_0/exp_avg"][0] += 1.0
    with pytest.raises(CheckpointError, match="CRC-32"):
        _fit(cfg)
    shard.write_bytes(backup.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="not readable HDF5"):
        _fit(cfg)
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        _fit(cfg)
    assert not (tmp_path / "again" / "checkpoints").exists()  # nothing written


def test_incompatible_or_damaged_manifest_is_refused(dataset_path, tmp_path):
    ckpt, _ = _damaged(tmp_path, dataset_path)
    other_model = _cfg(dataset_path, tmp_path / "x", **{"model.n_layer": 3,
                                                         "train.resume": str(ckpt)})
    with pytest.raises(CheckpointError, match="n_layer=2 \\(yours 3\\)"):
        _fit(other_model)
    (ckpt / "manifest.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        _fit(_cfg(dataset_path, tmp_path / "y", **{"train.resume": str(ckpt)}))
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        _fit(_cfg(dataset_path, tmp_path / "z", **{"train.resume": str(tmp_path / "nope")}))


def _poison_step(trainer, bad_step: int):
    """Make the loss NaN on forward number ``bad_step`` (0-based)."""
    calls = {"n": 0}

    def hook(_module, _args, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] == bad_step + 1 else output

    trainer.model.register_forward_hook(hook)


def test_non_finite_steps_are_skipped_or_abort(dataset_path, tmp_path):
    trainer = Trainer(tiny_config(dataset_path, tmp_path / "s",
                                  **{"train.on_nonfinite": "skip"}),
                      cpu_world(MPI.COMM_SELF), verbose=False)
    _poison_step(trainer, 3)
    result = trainer.fit()
    assert trainer.guard.skipped == 1 and np.isnan(result.losses[3])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert result.losses[-1] < result.losses[0] - 0.3  # training went on
    trainer = Trainer(tiny_config(dataset_path, tmp_path / "a"), cpu_world(MPI.COMM_SELF),
                      verbose=False)
    _poison_step(trainer, 3)
    with pytest.raises(NonFiniteError, match="on_nonfinite=skip"):
        trainer.fit()
