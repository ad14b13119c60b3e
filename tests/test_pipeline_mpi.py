"""Pipeline parallelism over real MPI ranks, against the single-process result.

At 2 ranks: pp=2. At 4 ranks: pp=4 and dp=2 x pp=2 (bucketed data parallelism and
ZeRO-1 along dp). Every schedule; per-step losses and final parameters equal the plain
single-process loop on the whole global batch.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import (LLAMA, SGD, TIMED, cpu_world, fit_against_reference,
                           fit_bf16_against_reference, same_on_all_ranks, tiny_config,
                           two_ranks_suffice)
from tests.reference import plain_model_config

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
FUSED = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)]
SCHEDULES = FUSED + [("zb-h1", 1), ("zbv", 1)]
"""The zero-bubble schedules' ZeRO-1, recompute and bf16 run in one test of their own, and
plain SGD is left to the fused schedules (the MPI legs' time)."""


def _pipeline_config(mpi_dataset, shared_tmp, pp, schedule, virtual, **extra):
    return tiny_config(mpi_dataset, shared_tmp, **{
        "model.n_layer": 8, "parallel.pp": pp, "parallel.micro_batches": 4,
        "parallel.schedule": schedule, "parallel.virtual_stages": virtual,
        "parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005,
        "train.max_iters": 6, **extra})


def _check(trainer, cfg):
    """First-step reduced gradients of every stage's parameters and the norm over the
    stages, every loss and the final parameters against the single-process run."""
    grid = trainer.grid
    # Replicas of one stage hold the same values; stages hold different parameters.
    _, ref = fit_against_reference(trainer, cfg, grid.dp_world.comm)
    if trainer.model.has_head:  # the head's copy of the tied embedding followed the update
        torch.testing.assert_close(trainer.model.head_weight.detach(), ref.params["wte.weight"],
                                   atol=1e-5, rtol=0)
    stats = trainer.runner.stats
    assert stats.messages > 0


@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(mpi_dataset, shared_tmp, pp, schedule, virtual):
    if COMM.size % pp:
        pytest.skip(f"pp={pp} needs a multiple of {pp} ranks")
    if pp * virtual > 8:
        pytest.skip("more chunks than layers")
    if schedule == "zbv" and COMM.size // pp > 1:
        pytest.skip("zbv's dp=2 x pp=2 runs in the Llama bf16 test (the 4-rank leg's time)")
    # zbv fills its V with 2 pp micro-batches; its head sits on stage 0 (no tied copy).
    # Its order here is built for unequal pass times (the Llama bf16 test runs the
    # equal-time order), which changes where each stage's F, B and W fall.
    extra = {"parallel.micro_batches": 2 * pp, "parallel.pass_times": TIMED} \
        if schedule == "zbv" else {}
    cfg = _pipeline_config(mpi_dataset, shared_tmp, pp, schedule, virtual, **extra)
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert (trainer.grid.dp, trainer.grid.pp) == (COMM.size // pp, pp)
    if schedule == "zbv":
        assert trainer.model.has_head == (trainer.grid.stage == 0)
        assert trainer.model.head_copy is None
    _check(trainer, cfg)
    if schedule in ("zb-h1", "zbv") and COMM.rank == 0:  # the times measured, and used
        passes = json.loads((Path(shared_tmp) / "summary.json").read_text())[
            "pipeline_pass_times"]
        assert passes["used"] == (TIMED if schedule == "zbv" else "1,1,1")
        assert 0 <= passes["predicted_idle"] < 1


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule,virtual", FUSED)
def test_zero1_along_dp_with_pipeline(mpi_dataset, shared_tmp, schedule, virtual):
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, schedule, virtual,
                           **{"parallel.zero": 1, "parallel.micro_batches": 2})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert (trainer.grid.dp, trainer.grid.pp) == (2, 2)
    _check(trainer, cfg)


@pytest.mark.parametrize("schedule,virtual", FUSED)
def test_pipeline_with_plain_sgd_matches_single_process(mpi_dataset, shared_tmp, schedule,
                                                        virtual):
    """pp=2 (with dp=2 at 4 ranks), SGD without clipping: any gradient scale error or a
    micro-batch's gradient lost or counted twice changes the loss at the second step."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, schedule, virtual, **SGD)
    _check(Trainer(cfg, cpu_world(COMM), verbose=False), cfg)


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_recompute_in_pipeline_stages_matches_the_plain_model(mpi_dataset, shared_tmp,
                                                              schedule, virtual):
    """Each stage runs its blocks again in its backward steps, interleaved with other
    micro-batches' forwards: the same results as the plain model on one process."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, schedule, virtual,
                           **{"model.recompute": "block"})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert all(block.recompute == "block" for block in trainer.model.h.values())
    _check(trainer, plain_model_config(cfg))


@pytest.mark.parametrize("schedule", [
    pytest.param("1f1b", marks=two_ranks_suffice(
        "the average over replicas is the same code as zbv's, which the 4-rank leg runs")),
    "zbv"])
def test_pipeline_eval_and_final_outputs(mpi_dataset, shared_tmp, schedule):
    """Validation losses averaged over replicas, and final.h5 put together from the stages.
    1F1B: evaluation's activations go down the stages and the loss comes from the last.
    zbv: its V places stage 1's layers in two chunks and the head on stage 0, evaluation
    hands the activation over locally at the V's tip, and final.h5 still holds every
    layer under its own name."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    from hpctrain.checkpoint.single_file import load_single_file
    common = {"train.eval_interval": 5, "train.eval_iters": 2, "train.final_eval": True,
              "train.save_checkpoint": True, "train.max_iters": 10}
    out = Path(shared_tmp)
    cfg = _pipeline_config(mpi_dataset, out / "pp", 2, schedule, 1, **common)
    result = Trainer(cfg, cpu_world(COMM), verbose=False).fit()
    assert result.val_losses.keys() == {5, 10}
    assert same_on_all_ranks(COMM, torch.tensor([result.final_val_loss, *result.val_losses.values()]))
    if COMM.rank == 0:  # the single-process run, on one rank
        ref_cfg = tiny_config(mpi_dataset, out / "ref", **{
            "model.n_layer": 8, "parallel.micro_batches": 4, **common})
        ref = Trainer(ref_cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
        for k in ref.val_losses:
            assert abs(result.val_losses[k] - ref.val_losses[k]) <= 1e-5
        assert abs(result.final_val_loss - ref.final_val_loss) <= 1e-5
        ckpt = load_single_file(out / "pp" / "final.h5")
        mine = load_single_file(out / "ref" / "final.h5")
        assert sorted(ckpt.model) == sorted(mine.model)
        for name, t in mine.model.items():
            np.testing.assert_allclose(ckpt.model[name], t, atol=1e-5, rtol=0)
    COMM.Barrier()


def test_grid_communicators():
    from hpctrain.comm.grid import ProcessGrid
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    world = cpu_world(COMM)
    grid = ProcessGrid.create(world, 2)
    assert grid.pp_comm.size == 2 and grid.dp_world.size == COMM.size // 2
    # Stage s of replica d is world rank 2 d + s: the pipeline's ranks are neighbours.
    assert COMM.rank == 2 * grid.dp_index + grid.stage
    assert grid.pp_comm.rank == grid.stage and grid.dp_world.comm.rank == grid.dp_index
    members = grid.pp_comm.allgather(COMM.rank)
    assert members == [2 * grid.dp_index, 2 * grid.dp_index + 1]
    assert grid.dp_world.comm.allgather(grid.stage) == [grid.stage] * grid.dp


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("allreduce", ["mpi", "shm"])
def test_dp_reductions_start_during_the_last_backward(mpi_dataset, shared_tmp, allreduce):
    """MPI reductions start from the hooks of the stage's last backward pass; sums in one
    node's shared memory all wait for finish() (no hooks there)."""
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, "1f1b", 1,
                           **{"comm.transport": allreduce})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    dp = trainer.engine
    assert len(dp.buckets) >= 2
    x, y = trainer.batches.train(0)
    trainer.runner.train_step(x.chunk(trainer.micro), y.chunk(trainer.micro),
                              dp.grad_scale / trainer.micro, dp.prepare_for_backward)
    launched_in_backward = dp.stats.reductions
    dp.finish()
    if allreduce == "mpi":
        assert launched_in_backward >= 1  # overlapped with the stage's last backward pass
    else:
        assert launched_in_backward == 0
    assert dp.stats.reductions == len(dp.buckets)
    trainer.close()


def _ckpt_config(mpi_dataset, out, pp, zero, **extra):
    return _pipeline_config(mpi_dataset, out, pp, "1f1b", 1, **{
        "train.max_iters": 10, "train.ckpt_interval": 5, "train.save_checkpoint": True,
        "parallel.zero": zero, "parallel.micro_batches": 2, **extra})


@pytest.mark.parametrize("zero", [0, 1])
def test_pipeline_checkpoint_resumes_bit_for_bit(mpi_dataset, shared_tmp, zero):
    from hpctrain.checkpoint.sharded import read_manifest
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    out = Path(shared_tmp)
    full = Trainer(_ckpt_config(mpi_dataset, out / "a", 2, zero), cpu_world(COMM),
                   verbose=False).fit()
    step5 = out / "a" / "checkpoints" / "step_000005"
    manifest = read_manifest(step5)
    assert manifest.world_size == COMM.size
    trainer = Trainer(_ckpt_config(mpi_dataset, out / "b", 2, zero,
                                   **{"train.resume": str(step5)}),
                      cpu_world(COMM), verbose=False)
    assert trainer.start.step == 5
    resumed = trainer.fit()
    assert resumed.losses == full.losses[5:]


@pytest.mark.parametrize("zero", [0, 1])
def test_pipeline_checkpoint_reshards_to_plain_data_parallelism_and_back(mpi_dataset,
                                                                         shared_tmp, zero):
    """pp=2 -> pp=1 (every rank data-parallel, other ZeRO level) -> pp=2: the losses
    continue the uninterrupted run's to fp32 round-off."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    out = Path(shared_tmp)
    full = Trainer(_ckpt_config(mpi_dataset, out / "pp", 2, zero), cpu_world(COMM),
                   verbose=False).fit()
    flat_cfg = tiny_config(mpi_dataset, out / "flat", **{
        "model.n_layer": 8, "parallel.micro_batches": 2 if COMM.size == 2 else 1,
        "parallel.zero": 1 - zero, "train.max_iters": 10, "train.ckpt_interval": 2,
        "train.save_checkpoint": True,
        "train.resume": str(out / "pp" / "checkpoints" / "step_000005")})
    flat = Trainer(flat_cfg, cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(flat.losses, full.losses[5:], atol=1e-5, rtol=0)
    back = Trainer(_ckpt_config(mpi_dataset, out / "back", 2, zero, **{
        "train.resume": str(out / "flat" / "checkpoints" / "step_000008")}),
        cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(back.losses, full.losses[8:], atol=1e-5, rtol=0)


@two_ranks_suffice("the V places chunks by stage, the same for every replica; dp=2 x "
                   "pp=2's shards and owners are the 1F1B test's")
def test_zbv_checkpoint_reshards_to_plain_data_parallelism_to_1f1b_and_back(mpi_dataset,
                                                                            shared_tmp):
    """zbv at pp=2 (stage 0 holds chunk 0, chunk 3 and the head; stage 1 chunks 1 and 2)
    -> pp=1 (ZeRO-1) -> zbv pp=2, and zbv -> 1F1B pp=2 (chunk g on stage g, the head on
    stage 1 with its copy of the tied embedding): the losses continue the uninterrupted
    zbv run's to fp32 round-off (the runs that stop at step 8 keep its learning rates)."""
    out = Path(shared_tmp)
    short = {"train.max_iters": 8, "optim.lr_decay_iters": 10}
    zbv = {"parallel.schedule": "zbv", "parallel.micro_batches": 4}
    full = Trainer(_ckpt_config(mpi_dataset, out / "zbv", 2, 0, **zbv), cpu_world(COMM),
                   verbose=False).fit()
    step5 = str(out / "zbv" / "checkpoints" / "step_000005")
    flat_cfg = tiny_config(mpi_dataset, out / "flat", **{
        "model.n_layer": 8, "parallel.micro_batches": 2, "parallel.zero": 1, **short,
        "train.ckpt_interval": 3, "train.save_checkpoint": True, "train.resume": step5})
    flat = Trainer(flat_cfg, cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(flat.losses, full.losses[5:8], atol=1e-5, rtol=0)
    back = Trainer(_ckpt_config(mpi_dataset, out / "back", 2, 0, **zbv, **{
        "train.resume": str(out / "flat" / "checkpoints" / "step_000008")}),
        cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(back.losses, full.losses[8:], atol=1e-5, rtol=0)
    other = Trainer(_ckpt_config(mpi_dataset, out / "1f1b", 2, 0, **short,
                                 **{"train.resume": step5}), cpu_world(COMM), verbose=False)
    assert other.model.has_head == (other.grid.stage == 1)
    np.testing.assert_allclose(other.fit().losses, full.losses[5:8], atol=1e-5, rtol=0)


@pytest.mark.parametrize("zero", [0, 1])
def test_bf16_pipeline_matches_the_bf16_single_process_run(mpi_dataset, shared_tmp, zero):
    """bf16 compute, fp32 master weights and moments, activations sent in bf16."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, "1f1b", 1, **{
        "train.dtype": "bf16", "parallel.zero": zero, "parallel.micro_batches": 2})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert trainer.runner.dtype == torch.bfloat16
    fit_bf16_against_reference(trainer, cfg)
    if trainer.model.has_head:  # the head computes with the embedding's bf16 values
        assert trainer.model.head_weight.dtype == torch.bfloat16


@pytest.mark.parametrize("schedule,micro", [("zb-h1", 2), ("zbv", 4)])
def test_zero_bubble_llama_in_bf16_matches_the_bf16_single_process_run(mpi_dataset, shared_tmp,
                                                                       schedule, micro):
    """zb-h1 and zbv (B and W apart) on Llama (untied head, RMSNorm, SwiGLU) in bf16 with
    ZeRO-1 and recomputed blocks (B runs them again, W reads what B recomputed): pp=2,
    with dp=2 at 4 ranks."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, schedule, 1, **{
        "train.dtype": "bf16", "parallel.zero": 1, "train.max_iters": 3,
        "parallel.micro_batches": micro, "model.recompute": "block", **LLAMA})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert all(block.recompute == "block" for block in trainer.model.h.values())
    fit_bf16_against_reference(trainer, cfg)
    stats = trainer.runner.stats
    assert stats.weight_s > 0  # W ran apart from B


@pytest.mark.slow
@two_ranks_suffice("the split backward of a compiled block is the same on every stage; "
                   "dp=2 x pp=2 of the zero-bubble schedules is the Llama bf16 test's")
@pytest.mark.parametrize("schedule,micro", [("zb-h1", 2), ("zbv", 4)])
def test_zero_bubble_with_compiled_blocks_matches_single_process(mpi_dataset, shared_tmp,
                                                                 schedule, micro):
    """zb-h1 and zbv with ``--train.compile``: a compiled block's backward is one autograd
    node, so B keeps the gradient of that node's output and W runs it again into the
    block's parameters only; B keeps the graph, which AOTAutograd's donated buffers
    refuse (``compile_model(backward_twice=True)`` turns them off)."""
    cfg = _pipeline_config(mpi_dataset, shared_tmp, 2, schedule, 1, **{
        "model.n_layer": 4, "parallel.micro_batches": micro, "train.max_iters": 3,
        "train.compile": True})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert all(block.compiled_body is not None for block in trainer.model.h.values())
    _check(trainer, plain_model_config(cfg))
    assert trainer.runner.stats.weight_s > 0  # W ran apart from B
