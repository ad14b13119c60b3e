"""The performance model's checkpoint term (``scaling/checkpoint_cost.py``): bytes per
rank, node and job by ZeRO level and layout, the write against the file system's and a
node's rates, the stall of a synchronous and an asynchronous save, and ``hpctrain plan
--ckpt-interval`` printing it. One process; arithmetic only."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR
from hpctrain.scaling import perfmodel as pm
from hpctrain.scaling.checkpoint_cost import (Checkpointing, checkpoint_bytes, checkpoint_cost,
                                              writers_on_first_node)
from hpctrain.scaling.models import preset_shape
from hpctrain.scaling.planner import Fixed, plan
from hpctrain.scaling.system_perf import load_perf
from hpctrain.systems.perf import FileSystem

POLARIS = Path(__file__).resolve().parents[1] / "hpctrain" / "systems" / "polaris.toml"
GB = 1e9


def _system(write=100.0, node=10.0, copy=20.0):
    """Polaris (4 ranks a node) with a file system of round rates in GB/s."""
    return dataclasses.replace(load_perf("polaris"),
                               filesystem=FileSystem("test", write * GB, node * GB, copy * GB))


def _arr(zero=0, pp=1, tp=1, cp=1, ranks=8):
    return pm.Arrangement(ranks=ranks, pp=pp, tp=tp, cp=cp, zero=zero, global_batch=64,
                          micro_batches=1, dtype="bf16", sequence_parallel=tp > 1)


def test_the_term_is_the_bytes_over_the_slower_of_the_two_rates():
    shape = preset_shape("gpt2")
    state = 12.0 * shape.params  # fp32 value + two moments, whatever the dtype
    system = _system(write=100.0, node=10.0, copy=20.0)
    # ZeRO-1 over 8 ranks: each writes 1/8, a node's 4 ranks half of it.
    c = checkpoint_cost(system, shape, _arr(zero=1), Checkpointing(10), 1.0, 0.0)
    assert c.job_bytes == pytest.approx(state)
    assert c.rank_bytes == pytest.approx(state / 8)
    assert c.node_bytes == pytest.approx(state / 2)
    assert c.write_s == pytest.approx(max(state / (100 * GB), state / 2 / (10 * GB)))
    assert c.copy_s == pytest.approx(state / 8 / (20 * GB))
    assert c.stall_s == pytest.approx(c.copy_s + c.write_s)  # synchronous: all of it
    assert c.hidden_s == 0.0
    assert c.per_step_s == pytest.approx(c.stall_s / 10)
    # A slow file system: the aggregate rate becomes the limit.
    slow = checkpoint_cost(_system(write=1.0, node=10.0), shape, _arr(zero=1),
                           Checkpointing(10), 1.0, 0.0)
    assert slow.write_s == pytest.approx(state / GB)


def test_zero3_writes_a_shard_per_rank_zero0_the_first_replica_all():
    shape = preset_shape("gpt2")
    state = 12.0 * shape.params
    r3, n3, j3 = checkpoint_bytes(shape, _arr(zero=3), 4)
    r0, n0, j0 = checkpoint_bytes(shape, _arr(zero=0), 4)
    assert j3 == j0 == pytest.approx(state)
    assert r3 == pytest.approx(state / 8) and n3 == pytest.approx(state / 2)
    assert r0 == pytest.approx(state) and n0 == pytest.approx(state)  # rank 0 writes alone
    # Two stages: dp rank 0 of each stage (ranks 0 and 1) share the first node.
    assert writers_on_first_node(_arr(zero=0, pp=2), 4) == 2
    r, n, _ = checkpoint_bytes(shape, _arr(zero=0, pp=2), 4)
    assert n == pytest.approx(2 * r)
    # tp=2 x pp=2 on 8 ranks: the first replica is ranks 0-3, all on the first node.
    assert writers_on_first_node(_arr(zero=0, pp=2, tp=2), 4) == 4
    # cp=2: ranks 0 and 1 hold the same weights; only context rank 0 writes them, and
    # ZeRO shards the state over dp x cp = 8 ranks, not dp = 4.
    assert writers_on_first_node(_arr(zero=0, cp=2), 4) == 1
    r, n, _ = checkpoint_bytes(shape, _arr(zero=1, cp=2), 4)
    assert r == pytest.approx(state / 8) and n == pytest.approx(state / 2)


def test_an_asynchronous_write_is_hidden_when_the_interval_is_long_enough():
    shape = preset_shape("gpt2")
    system = _system(write=100.0, node=0.1, copy=20.0)  # a slow node: a long write
    arr = _arr(zero=1)
    sync = checkpoint_cost(system, shape, arr, Checkpointing(100), 0.5, 1e-3)
    write = sync.write_s
    assert write > 1.0
    steps = int(write / 0.5) + 1  # enough steps for the writer to finish
    hidden = checkpoint_cost(system, shape, arr, Checkpointing(steps, True), 0.5, 1e-3)
    assert hidden.hidden_s == pytest.approx(write)
    # The copy and one agreement at the start and per step in flight; no write.
    assert hidden.agree_s == pytest.approx(1e-3 * (1 + steps))
    assert hidden.stall_s == pytest.approx(hidden.copy_s + hidden.agree_s)
    assert sync.stall_s == pytest.approx(hidden.copy_s + write)
    short = checkpoint_cost(system, shape, arr, Checkpointing(1, True), 0.5, 1e-3)
    assert short.hidden_s == pytest.approx(0.5)  # one step's worth overlaps
    assert short.stall_s == pytest.approx(short.copy_s + 2e-3 + write - 0.5)


def test_the_plan_adds_the_term_to_the_step():
    fixed = Fixed(dp=4, zero=1, micro_batch=8)
    bare = plan(system="polaris", nodes=1, model="gpt2", fixed=fixed)
    saved = plan(system="polaris", nodes=1, model="gpt2", fixed=fixed,
                 checkpointing=Checkpointing(50))
    q0, q1 = bare.fitting[0].prediction, saved.fitting[0].prediction
    assert q0.ckpt_s == 0.0 and q0.checkpoint is None
    assert q1.ckpt_s == pytest.approx(q1.checkpoint.stall_s / 50)
    assert q1.step_s == pytest.approx(q0.step_s + q1.ckpt_s)


def _cli(capsys, *args):
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_prints_the_checkpoint_column_and_terms(capsys):
    code, out, err = _cli(capsys, "--system", "polaris", "--nodes", "1", "--model", "gpt2",
                          "--top", "2", "--ckpt-interval", "20", "--ckpt-async", "--explain")
    assert code == 0 and err == ""
    assert "asynchronous checkpoints every 20 steps to Eagle (Lustre)" in out
    assert " ckpt " in out.splitlines()[2]
    assert "checkpoint stall per save (asynchronous, every 20 steps)" in out
    assert "checkpoint per step" in out
    code, out, _ = _cli(capsys, "--system", "polaris", "--nodes", "1", "--model", "gpt2")
    assert "ckpt" not in out and "checkpoint" not in out
    code, _, err = _cli(capsys, "--system", "polaris", "--nodes", "1", "--model", "gpt2",
                        "--ckpt-async")
    assert code == EXIT_USER_ERROR and "--ckpt-interval" in err


def test_a_system_without_a_filesystem_table_gets_one_warning(tmp_path, capsys):
    text = POLARIS.read_text()
    f = tmp_path / "nofs.toml"
    f.write_text(text[:text.index("[perf.filesystem]")])
    code, _, err = _cli(capsys, "--system", str(f), "--nodes", "1", "--model", "gpt2")
    assert code == 0 and "warning" not in err  # not asked for: nothing said
    code, out, err = _cli(capsys, "--system", str(f), "--nodes", "1", "--model", "gpt2",
                          "--ckpt-interval", "10")
    lines = [x for x in err.splitlines() if x.startswith("warning:")]
    assert code == 0 and len(lines) == 1
    assert "[perf.filesystem]" in lines[0] and "inter link" in lines[0]
    assert "an unknown file system" in out
    again = _cli(capsys, "--system", str(f), "--nodes", "1", "--model", "gpt2",
                 "--ckpt-interval", "10")[2]
    assert "warning" not in again  # once per file and key
