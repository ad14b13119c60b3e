"""One run per out_dir: a lock naming its holder, no fresh run on top of an earlier one
(resume or overwrite, never mix), and no job whose MPI world differs from what the
launcher started (N independent 1-rank copies)."""

import json
import os
import socket
import sys

import pytest
from mpi4py import MPI

from hpctrain.checkpoint.sharded import read_manifest
from hpctrain.comm.world_check import LaunchMismatch, check_world_size
from hpctrain.train.rundir_lock import LOCK_NAME, RunDirError
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, hpctrain_cmd, run, tiny_config


def _fit(dataset_path, out, **over):
    cfg = tiny_config(dataset_path, out, **{"train.save_checkpoint": True, **over})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    return trainer, trainer.fit()


def test_a_fresh_run_into_a_used_out_dir_is_refused_naming_resume_and_overwrite(
        dataset_path, tmp_path):
    _fit(dataset_path, tmp_path, **{"train.ckpt_interval": 5})
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    with pytest.raises(RunDirError, match=r"--train.resume=auto.*--train.overwrite"):
        _fit(dataset_path, tmp_path, **{"train.max_iters": 5})
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    assert after == before  # nothing written, nothing removed
    assert not (tmp_path / LOCK_NAME).exists()  # the refused run let go of the lock


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(dataset_path, tmp_path):
    _fit(dataset_path, tmp_path)
    old_metrics = (tmp_path / "metrics.jsonl").read_text()
    _fit(dataset_path, tmp_path, **{"train.overwrite": True, "train.max_iters": 5})
    previous = list(tmp_path.glob("previous-*"))
    assert len(previous) == 1
    assert (previous[0] / "metrics.jsonl").read_text() == old_metrics
    assert read_manifest(previous[0]).step == 10
    assert read_manifest(tmp_path).step == 5  # the new run's own, alone in checkpoints/
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000005"]


def test_resume_auto_continues_the_run_in_place(dataset_path, tmp_path):
    _fit(dataset_path, tmp_path, **{"train.max_iters": 5})
    trainer, _ = _fit(dataset_path, tmp_path, **{"train.resume": "auto"})
    assert trainer.start.step == 5 and read_manifest(tmp_path).step == 10


def test_a_resume_with_another_seed_or_batch_warns_and_records_it(dataset_path, tmp_path):
    """Allowed (a requeue may change them on purpose) but never silent: the batches then
    differ from the ones the run would have drawn."""
    _fit(dataset_path, tmp_path, **{"train.max_iters": 5})
    trainer, _ = _fit(dataset_path, tmp_path, **{"train.resume": "auto", "train.seed": 7,
                                                  "train.batch_size": 4})
    assert trainer.start.changed == ("train.seed: 1337 -> 7", "train.batch_size: 8 -> 4")
    assert "warning: changed since that run: train.seed: 1337 -> 7" in trainer.start.describe()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["changed_on_resume"] == list(trainer.start.changed)
    same, _ = _fit(dataset_path, tmp_path / "same", **{"train.max_iters": 5})
    same, _ = _fit(dataset_path, tmp_path / "same", **{"train.resume": "auto"})
    assert same.start.changed == () and "warning" not in same.start.describe()


def test_resume_auto_without_a_checkpoint_moves_the_earlier_attempt_aside(dataset_path,
                                                                         tmp_path):
    """A requeued job killed before its first save left outputs and no checkpoint: its
    next attempt, run with --train.resume=auto as job scripts do, starts fresh."""
    _fit(dataset_path, tmp_path, **{"train.save_checkpoint": False, "train.max_iters": 5})
    old_metrics = (tmp_path / "metrics.jsonl").read_text()
    trainer, _ = _fit(dataset_path, tmp_path, **{"train.resume": "auto"})
    assert trainer.start.step == 0 and read_manifest(tmp_path).step == 10
    previous = list(tmp_path.glob("previous-*"))
    assert len(previous) == 1 and (previous[0] / "metrics.jsonl").read_text() == old_metrics
    assert any("found no checkpoint to continue" in n for n in trainer.lock.notes)


def _lock(out, host, pid):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "job": "4242",
                                             "started": "2026-11-24T00:00:00Z"}))


def test_a_live_run_holding_the_out_dir_is_named_and_not_disturbed(dataset_path, tmp_path):
    _lock(tmp_path, socket.gethostname(), os.getppid())  # a live process, not us
    with pytest.raises(RunDirError, match=rf"in use by another run \(host "
                                          rf"{socket.gethostname()}, PID {os.getppid()}, "
                                          rf"job 4242.*remove .*{LOCK_NAME}"):
        _fit(dataset_path, tmp_path)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getppid()
    _lock(tmp_path, "another-node", 1)  # another host cannot be checked: refused too
    with pytest.raises(RunDirError, match="host another-node"):
        _fit(dataset_path, tmp_path)


def test_a_stale_lock_of_a_dead_process_is_taken_over(dataset_path, tmp_path):
    dead = run([sys.executable, "-c", "import os; print(os.getpid())"]).stdout.strip()
    _lock(tmp_path, socket.gethostname(), int(dead))
    _, result = _fit(dataset_path, tmp_path)
    assert len(result.losses) == 10
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


@pytest.mark.parametrize("env,message", [
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, "srun --mpi=pmix"),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, "OMPI_COMM_WORLD_SIZE=4"),
    ({"PMI_SIZE": "2"}, "PMI_SIZE=2"),
])
def test_a_world_that_is_not_the_launched_job_is_refused(env, message):
    with pytest.raises(LaunchMismatch, match=message):
        check_world_size(1, env)


@pytest.mark.parametrize("size,env", [
    (1, {}),
    (2, {"PMI_SIZE": "2"}),
    (4, {"OMPI_COMM_WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}),
    # mpiexec inside an allocation, its ranks started through one srun task per node
    (8, {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}),
])
def test_a_matching_world_passes(size, env):
    check_world_size(size, env)


@pytest.mark.slow
def test_srun_copies_of_one_rank_fail_at_start_with_the_fix(dataset_path, tmp_path):
    """What srun without an MPI plugin does: each task is a 1-rank MPI job."""
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "77"}
    p = run(hpctrain_cmd("train", "default", f"--data.path={dataset_path}",
                         f"--train.out_dir={tmp_path}/out"), env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "srun started 2 tasks" in p.stderr and "--mpi=pmix" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()


def test_temporaries_of_a_killed_save_are_removed_at_the_next_start(dataset_path, tmp_path):
    _fit(dataset_path, tmp_path, **{"train.max_iters": 5})
    root = tmp_path / "checkpoints"
    (root / ".step_000010.abc123.tmp").mkdir()  # what kill -9 during a save leaves
    (root / ".step_000010.abc123.tmp" / "rank_00000.h5").write_bytes(b"partial")
    (root / ".latest.xyz").write_text("step_000010\n")
    trainer, _ = _fit(dataset_path, tmp_path, **{"train.resume": "auto"})
    assert any("removed 2 temporary" in n for n in trainer.lock.notes)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000005", "step_000010"]


@pytest.mark.slow
def test_srun_copies_of_one_rank_do_not_prepare_data_either(tmp_path):
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2"}
    p = run(hpctrain_cmd("prepare", "--corpus", "stdlib", "--max-bytes", "20000", "--output",
                         str(tmp_path / "d.h5")), env=env, timeout=120)
    assert p.returncode == 2 and "srun started 2 tasks" in p.stderr, p.stderr
    assert not (tmp_path / "d.h5").exists()


def _steps(root):
    return sorted(p.name for p in root.glob("step_*"))


@pytest.mark.parametrize("resume", ["step", "latest"])
def test_resuming_from_an_older_step_keeps_it_and_moves_the_newer_aside(dataset_path,
                                                                        tmp_path, resume):
    """Before: the newer step_30 stayed, outranked the resumed run's saves, and pruning
    (keep 2) deleted step_20, the resume source. ``latest``: a latest pointing at an
    older step than others beside it (written by hand, or by an older hpctrain)."""
    over = {"train.max_iters": 30, "train.ckpt_interval": 10, "train.ckpt_keep": 2}
    _fit(dataset_path, tmp_path, **over)
    root = tmp_path / "checkpoints"
    assert _steps(root) == ["step_000020", "step_000030"]
    source = "auto" if resume == "latest" else str(root / "step_000020")
    if resume == "latest":
        (root / "latest").write_text("step_000020\n")
    trainer, result = _fit(dataset_path, tmp_path, **{**over, "train.max_iters": 25,
                                                      "train.resume": source})
    assert trainer.start.step == 20 and len(result.losses) == 5
    assert _steps(root) == ["step_000020", "step_000025"]
    assert (root / "latest").read_text().strip() == "step_000025"
    moved = list(tmp_path.glob("previous-*/checkpoints/step_000030"))
    assert len(moved) == 1 and read_manifest(moved[0]).step == 30
    assert any("abandons the newer checkpoint(s) step_000030" in n
               for n in trainer.lock.notes)


def test_resuming_from_another_runs_checkpoint_moves_nothing(dataset_path, tmp_path):
    _fit(dataset_path, tmp_path / "a", **{"train.ckpt_interval": 5})
    _fit(dataset_path, tmp_path / "b", **{"train.max_iters": 5})
    trainer, _ = _fit(dataset_path, tmp_path / "b", **{
        "train.resume": str(tmp_path / "a" / "checkpoints" / "step_000005")})
    assert not list((tmp_path / "b").glob("previous-*"))
    assert _steps(tmp_path / "a" / "checkpoints") == ["step_000005", "step_000010"]
