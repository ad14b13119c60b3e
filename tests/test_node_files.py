"""``--train.ckpt_files=node`` on one process: the file it writes, its manifest checked
where it is read, the combinations refused. Several ranks and nodes:
``test_node_files_mpi.py``."""

import json
import shutil

import h5py
import pytest
from mpi4py import MPI

from hpctrain.checkpoint.ckpt_commands import inspect
from hpctrain.checkpoint.sharded import CheckpointError, read_manifest
from hpctrain.comm.world import RANKS_PER_NODE_ENV
from hpctrain.config import ConfigError
from hpctrain.errors import UserError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

STEP = "checkpoints/step_000005"


def _fit(data, out, **overrides):
    cfg = tiny_config(data, out, **{"train.max_iters": 8, "train.ckpt_interval": 5,
                                    "train.save_checkpoint": True,
                                    "parallel.zero": 1, **overrides})
    return Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()


@pytest.fixture(scope="module")
def node_run(dataset_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("node")
    _fit(dataset_path, out, **{"train.ckpt_files": "node"})
    return out


def test_one_rank_writes_one_node_file_with_its_group_and_resumes(node_run, dataset_path,
                                                                  tmp_path):
    step = node_run / STEP
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "node_00000.h5"]
    with h5py.File(step / "node_00000.h5") as f:
        assert list(f) == ["rank_00000"] and f["rank_00000"].attrs["rank"] == 0
    assert read_manifest(step).data["node_files"] == {"node_00000.h5": [0]}
    rank_run = _fit(dataset_path, tmp_path / "rank")
    resumed = _fit(dataset_path, tmp_path / "resumed", **{"train.resume": str(step)})
    assert len(resumed.losses) == 3
    assert resumed.losses == rank_run.losses[5:]


@pytest.mark.parametrize("files,message", [
    ({"node_00000.h5": [0, 0]}, "node_files lists rank 0 twice"),
    ({"node_00000.h5": []}, "node_files lists no file for rank 0"),
    ({"../node_00000.h5": [0]}, "not a file like node_00000.h5"),
    ({"node_00000.h5": [1]}, r"node_files\['node_00000.h5'\] entry is 1"),
    ([0], "node_files is .*not a JSON object"),
])
def test_a_damaged_node_files_record_is_one_clear_error(node_run, tmp_path, files, message):
    step = shutil.copytree(node_run / STEP, tmp_path / "step_000005")
    mf = step / "manifest.json"
    mf.write_text(json.dumps({**json.loads(mf.read_text()), "node_files": files}))
    with pytest.raises(CheckpointError, match=message):
        read_manifest(step)


def test_a_missing_node_file_or_group_is_named(node_run, tmp_path):
    step = shutil.copytree(node_run / STEP, tmp_path / "step_000005")
    with h5py.File(step / "node_00000.h5", "a") as f:
        f.move("rank_00000", "rank_00009")
    with pytest.raises(CheckpointError, match="has no group rank_00000"):
        inspect(step, verify=True)
    (step / "node_00000.h5").unlink()
    with pytest.raises(CheckpointError, match="node_00000.h5 is missing"):
        inspect(step, verify=True)


def test_node_files_with_asynchronous_saves_are_refused(dataset_path, tmp_path):
    with pytest.raises(ConfigError, match="--train.ckpt_files=rank"):
        tiny_config(dataset_path, tmp_path, **{"train.ckpt_files": "node",
                                               "train.ckpt_async": True})


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_simulated_node_size_is_refused(monkeypatch, value):
    monkeypatch.setenv(RANKS_PER_NODE_ENV, value)
    with pytest.raises(UserError, match=RANKS_PER_NODE_ENV):
        cpu_world(MPI.COMM_SELF)


@pytest.mark.slow
def test_a_full_disk_under_a_node_writer_keeps_the_previous_checkpoint(dataset_path, tmp_path):
    """2 ranks on one simulated node write into a real tmpfs (``tests/full_disk.py``),
    filled after the checkpoint of step 5: the save of step 10 fails on the writer with
    one message, exit status 2, and step 5 stays ``latest``, whole and verified."""
    from tests.full_disk import fill, small_filesystem
    from tests.helpers import hpctrain_cmd, mpiexec, run

    def train(*extra):
        return run(mpiexec(2, *hpctrain_cmd(
            "train", "default", f"--data.path={dataset_path}", f"--train.out_dir={out}",
            "--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32",
            "--model.block_size=16", "--train.batch_size=8", "--train.eval_interval=0",
            "--train.sample_tokens=0", "--train.progress=false", "--data.verify=false",
            "--train.ckpt_interval=5", "--train.ckpt_files=node", *extra)),
            timeout=180, env={RANKS_PER_NODE_ENV: "2"})

    with small_filesystem("1m") as point:
        if point is None:
            pytest.skip(small_filesystem.why)
        out = tmp_path / "run"
        p = train("--train.max_iters=5")
        assert p.returncode == 0, p.stderr
        root = out / "checkpoints"
        for item in root.iterdir():
            shutil.move(item, point / item.name)
        root.rmdir()
        root.symlink_to(point)
        fill(point)
        p = train("--train.max_iters=10", "--train.resume=auto")
        (point / "filler").unlink()
        assert p.returncode == 2, p.stderr
        assert "saving checkpoint step 10 failed: rank 0" in p.stderr
        assert "No space left" in p.stderr or "ENOSPC" in p.stderr, p.stderr[-2000:]
        assert (point / "latest").read_text().strip() == "step_000005"
        assert not list(point.glob(".step_*"))
        assert "verified" in inspect(point / "step_000005", verify=True)
