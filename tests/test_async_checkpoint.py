"""Asynchronous checkpoints (``--train.ckpt_async``) in one process: the same bytes as
synchronous ones, training going on while a (deliberately slow) writer writes, ``latest``
moving only after the write, host buffers reused, and the fall-back to a synchronous
save where the copy would not fit in memory. Several ranks: test_async_checkpoint_mpi.py;
kill -9, a full disk and SIGTERM during a write: test_async_checkpoint_failures.py."""

import threading
import time

import torch
from mpi4py import MPI

import hpctrain.checkpoint.distributed as distributed
from hpctrain.checkpoint.host_buffers import HostBuffers
from hpctrain.checkpoint.sharded import write_shard
from tests.checkpoint_content import checkpoint_content
from hpctrain.train.trainer import Trainer
from tests.checkpoint_content import assert_same_checkpoints
from tests.helpers import cpu_world, tiny_config

WAIT_S = 60  # a writer waiting for steps that never come fails the test, not the suite


def _cfg(data, out, **overrides):
    return tiny_config(data, out, **{"train.ckpt_interval": 2, "train.ckpt_keep": 0,
                                     "train.max_iters": 6,
                                     "train.save_checkpoint": True, **overrides})


def _trainer(cfg):
    return Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)


def test_a_slow_async_writer_overlaps_training_and_writes_what_a_sync_save_does(
        dataset_path, tmp_path, monkeypatch):
    """Each asynchronous write waits until two more training steps have run, then a
    little longer (time for a buffer reused too early to be overwritten); meanwhile
    ``latest`` still names the previous checkpoint. The checkpoints are the synchronous
    run's, byte for byte, and a resume from one continues the run bit for bit."""
    sync = _trainer(_cfg(dataset_path, tmp_path / "sync"))
    full = sync.fit()
    trainer = _trainer(_cfg(dataset_path, tmp_path / "async", **{"train.ckpt_async": True}))
    root = tmp_path / "async" / "checkpoints"
    real, seen = distributed.write_shard, []

    def slow_write(path, datasets, attrs, **kwargs):
        step = attrs["step"]
        if threading.current_thread() is threading.main_thread():
            return real(path, datasets, attrs, **kwargs)  # the final save: synchronous
        for _ in range(WAIT_S * 100):  # bounded: two steps trained while this waits
            if trainer.saver.overlapped.get(step, 0) >= 2:
                break
            time.sleep(0.01)
        else:
            raise RuntimeError(f"no training step ran while step {step} was being written")
        time.sleep(0.2)
        latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
        seen.append((step, latest, (root / f"step_{step:06d}").exists()))
        return real(path, datasets, attrs, **kwargs)

    monkeypatch.setattr(distributed, "write_shard", slow_write)
    saves = []  # what the deadline's margin hears: an async save from start to publication
    trainer.saver.on_saved = saves.append
    result = trainer.fit()
    assert len(saves) == 3 and min(saves[:2]) >= 0.2  # each write was held >= 0.2 s
    assert trainer.saver.overlapped == {2: 2, 4: 2}
    assert seen == [(2, None, False), (4, "step_000002", False)]  # 6, the last: sync
    assert result.losses == full.losses
    assert_same_checkpoints(root, tmp_path / "sync" / "checkpoints")
    monkeypatch.setattr(distributed, "write_shard", real)
    resumed = _trainer(_cfg(dataset_path, tmp_path / "resumed", **{
        "train.ckpt_async": True, "train.resume": str(root / "step_000004")})).fit()
    assert resumed.losses == full.losses[4:]


def test_a_copy_that_does_not_fit_saves_synchronously_with_one_warning(dataset_path,
                                                                      tmp_path, monkeypatch):
    trainer = _trainer(_cfg(dataset_path, tmp_path, **{"train.ckpt_interval": 0}))
    trainer.fit(close=False)
    lines = []
    trainer.saver.log = lines.append
    monkeypatch.setattr(distributed, "available_bytes", lambda: 1000)
    assert trainer.saver.save(11, asynchronous=True) == tmp_path / "checkpoints/step_000011"
    assert trainer.saver.save(12, asynchronous=True) is not None  # synchronous again
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "would not fit" in warnings[0], lines
    monkeypatch.setattr(distributed, "available_bytes", lambda: None)  # unknown: fits
    assert trainer.saver.save(13, asynchronous=True) is None
    trainer.saver.finish_pending()
    assert (tmp_path / "checkpoints/latest").read_text().strip() == "step_000013"
    trainer.close()


def test_host_buffers_are_reused_while_the_shapes_stay():
    buffers = HostBuffers()
    a = {"x": torch.arange(6.0).reshape(2, 3), "rng": torch.arange(4, dtype=torch.uint8)}
    first = buffers.copy(a)
    pointers = {k: v.ctypes.data for k, v in first.items()}
    a["x"] += 1
    second = buffers.copy(a)
    assert {k: v.ctypes.data for k, v in second.items()} == pointers
    assert second["x"].tolist() == [[1, 2, 3], [4, 5, 6]] and second["rng"].dtype.name == "uint8"
    a["x"] += 1  # the copy is a copy: the training's changes do not reach it
    assert second["x"][0, 0] == 1
    assert buffers.fits(a, local_ranks=4, available=0)  # reused: no new memory
    b = {"x": torch.zeros(3, 3, dtype=torch.bfloat16), "rng": a["rng"]}
    assert not buffers.fits(b, local_ranks=1, available=10)
    assert buffers.fits(b, local_ranks=2, available=int(2 * (36 + 4) / 0.8) + 1)
    assert buffers.copy(b)["x"].dtype.name == "float32"  # remade, fp32 as the shard stores


def test_a_shard_written_in_pieces_holds_the_same_datasets(tmp_path):
    """The writer thread's pieces (rows of 2-D tensors, runs of a flat bucket, a last
    short piece) give the datasets and CRC-32s of one write per dataset."""
    data = {"param/w": torch.randn(37, 5).numpy(), "bucket_0/param": torch.randn(1001).numpy(),
            "rng/torch": torch.get_rng_state().numpy(), "one": torch.randn(()).numpy()}
    for folder, piece in (("whole", 0), ("pieces", 64)):
        (tmp_path / folder).mkdir()
        crcs = write_shard(tmp_path / folder / "rank_00000.h5", data, {"step": 1},
                           piece_bytes=piece)
        (tmp_path / folder / "manifest.json").write_text(
            '{"config": {"train": {}}, "crc32": %d}' % sum(crcs.values()))
    assert checkpoint_content(tmp_path / "whole") == checkpoint_content(tmp_path / "pieces")


def test_old_checkpoints_are_deleted_off_the_main_thread_and_gone_at_the_end(
        dataset_path, tmp_path, monkeypatch):
    """With ``--train.ckpt_keep=1`` an asynchronous save's publication hands the
    deletion of the older checkpoint to a thread (deleting many GB would stall training),
    and the run waits for it at its end: only the newest is left."""
    import hpctrain.checkpoint.sharded as sharded
    real, threads = sharded.prune, []

    def recorded(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(*args)

    monkeypatch.setattr(sharded, "prune", recorded)
    cfg = _cfg(dataset_path, tmp_path, **{"train.ckpt_async": True, "train.ckpt_keep": 1})
    _trainer(cfg).fit()
    root = tmp_path / "checkpoints"
    assert threads[:2] == [False, False]  # steps 2 and 4: async; 6, the last: sync
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000006"]
