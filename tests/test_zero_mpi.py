"""ZeRO levels 1-3 and bf16 over real MPI ranks, against the single-process result.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.config import OptimConfig
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.memory import zero_formula
from hpctrain.parallel.data_parallel import DataParallel
from hpctrain.parallel.zero import Zero
from hpctrain.parallel.memory import STAGED_AT_ONCE
from hpctrain.train.trainer import Trainer
from tests.helpers import (SGD, bf16_accumulation_check, cpu_world, fit_against_reference,
                           fit_bf16_against_reference, tiny_config, two_ranks_suffice)
from tests.reference import plain_model_config, reference_run

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _config(data, out, **overrides):
    return tiny_config(data, out, **{"parallel.bucket_mb": 0.02,
                                     "parallel.first_bucket_mb": 0.005, **overrides})


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_zero_matches_single_process_fp32(mpi_dataset, shared_tmp, level, micro_batches):
    """First-step reduced gradients (shards gathered) and norm, losses, parameters."""
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": level,
                                              "parallel.micro_batches": micro_batches})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_against_reference(trainer, cfg, COMM)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_zero_with_plain_sgd_matches_single_process(mpi_dataset, shared_tmp, level):
    """SGD without clipping: a gradient scale error shows in the loss at the second step."""
    cfg = _config(mpi_dataset, shared_tmp, **SGD, **{"parallel.zero": level,
                                                     "parallel.micro_batches": 2})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_against_reference(trainer, cfg, COMM)


@pytest.mark.parametrize("compile_", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("level", [2, 3])
def test_recompute_with_zero_matches_the_plain_model(mpi_dataset, shared_tmp, level,
                                                     compile_):
    """ZeRO-3 gathers a block's parameters in its forward pre-hook and frees them after
    it, and gathers them again when the gradient reaches the block's output: the
    recomputation that backward then starts must find them gathered (it runs inside the
    block, after that gather). Two micro-batches: the second forward gathers again.
    With compile, the hooks stay outside the compiled block bodies."""
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": level,
                                              "parallel.micro_batches": 2,
                                              "model.recompute": "block",
                                              "train.compile": compile_})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_against_reference(trainer, plain_model_config(cfg), COMM)
    if level == 3:  # every gathered block was freed again
        assert trainer.engine.gathered_bytes == 0


def test_clipping_uses_the_global_norm_over_all_shards(mpi_dataset, shared_tmp):
    # A clip threshold far below the gradient norm: every step is clipped, so a norm
    # computed over this rank's shard only would give different updates at once.
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": 2, "optim.grad_clip": 0.05})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    result = trainer.fit()
    np.testing.assert_allclose(result.losses, reference_run(cfg).losses, atol=1e-5, rtol=0)


def test_grad_norm_over_shards_equals_the_unsharded_norm():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, 32, (2 * COMM.size, 8), generator=torch.Generator().manual_seed(1))
    reference = GPT(cfg)
    reference(x, x).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    for level in (1, 2, 3):
        torch.manual_seed(0)
        model = GPT(cfg)
        zero = Zero(model, cpu_world(COMM), OptimConfig(), level=level,
                    blocks=list(model.h))
        rows = slice(2 * COMM.rank, 2 * COMM.rank + 2)
        zero.prepare_for_backward(last_micro=True)
        (model(x[rows], x[rows]) * zero.grad_scale).backward()
        zero.finish()
        assert zero.grad_norm() == pytest.approx(float(expected), rel=1e-5), level


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bf16_matches_the_bf16_single_process_run(mpi_dataset, shared_tmp, level,
                                                  micro_batches):
    cfg = _config(mpi_dataset, shared_tmp, **{"parallel.zero": level, "train.dtype": "bf16",
                                              "parallel.micro_batches": micro_batches})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    result, _ = fit_bf16_against_reference(trainer, cfg)
    assert result.losses[-1] < result.losses[0] - 0.3  # it learns


@two_ranks_suffice("each rank accumulates its micro-batches in fp32 before any reduction")
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bf16_micro_batches_accumulate_and_reduce_in_fp32(level):
    """16 micro-batches per rank: the reduced gradient is the fp32 sum of every rank's
    and micro-batch's bf16 gradients (to fp32 rounding: the order of the additions
    differs), where a sum in bf16, or a reduced sum rounded back to bf16, is off by bf16
    ulps of the largest element."""
    err, err_bf16 = bf16_accumulation_check(COMM, level)
    assert err <= 1e-6
    assert err_bf16 > 1e-3  # the check can tell the two apart


@two_ranks_suffice("the pool is each rank's own; its budget counts that rank's buckets")
@pytest.mark.parametrize("level", [2, 3])
def test_the_staging_pool_holds_at_most_its_budget_with_the_same_gradients(level):
    """Levels 2-3 in bf16 with many small buckets of several lengths. The default budget
    holds at most ``STAGED_AT_ONCE`` of the largest bucket (a budget of every bucket's
    bytes lets the pool keep one buffer per bucket: the whole gradient in fp32); with
    that larger budget no hook ever waits. A budget below one bucket keeps no reduction
    in flight when a bucket needs a buffer (hooks wait instead). All give the same
    gradients."""
    grads, pools = [], []
    for staging_mb in (None, 1e3, 1e-9):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_head=2, n_embd=32))
        zero = Zero(model, cpu_world(COMM), OptimConfig(), level=level, dtype="bf16",
                    bucket_mb=0.01, first_bucket_mb=0.002, blocks=list(model.h),
                    staging_mb=staging_mb)
        assert len(zero.buckets) >= 4
        staged = [b.layout.padded * 4 for b in zero.buckets]
        biggest = max(staged)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(COMM.rank))
        for _ in range(2):
            zero.zero_grad()
            zero.prepare_for_backward(last_micro=True)
            (model(x, x) * zero.grad_scale).backward()
            zero.finish()
        grads.append(torch.cat([b.grad_shard for b in zero.buckets]))
        pools.append((zero.staging.refusals, zero.staging.nbytes, zero.memory().comm_buffers))
        zero.close()
    (_, held, comm_bytes), (refused_all, held_all, _), (refused_small, held_small, _) = pools
    assert 0 < held <= min(sum(staged), STAGED_AT_ONCE * biggest) and held <= comm_bytes
    assert refused_all == 0  # every bucket could be in flight
    if level == 2:  # many lengths: the unbounded pool keeps more than the default bound
        assert held_all > STAGED_AT_ONCE * biggest
    # A bucket still filling keeps its buffer (ZeRO-3's embeddings unit gets the final
    # LayerNorm's gradient first and the tied embedding's last): two buffers at most here.
    assert refused_small > 0 and 0 < held_small <= 2 * biggest and held_small < held_all
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_model_state_bytes_follow_the_zero_formulas(level, dtype):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=128))
    n = sum(p.numel() for p in model.parameters())
    if level == 0 and dtype == "fp32":  # plain data parallelism and its own AdamW
        dp = DataParallel(model, cpu_world(COMM), OptimConfig(), allreduce="mpi")
        dp.step(1e-3, 0.0)  # AdamW makes its moments at the first step
        per_param = dp.memory().per_param(n)
        dp.close()
    else:
        zero = Zero(model, cpu_world(COMM), OptimConfig(), level=level, dtype=dtype,
                    blocks=list(model.h))
        per_param = zero.memory().per_param(n)
    assert per_param == pytest.approx(zero_formula(level, dtype, COMM.size), rel=0.05)


def test_optimizer_state_is_exposed_per_shard():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    n = sum(p.numel() for p in model.parameters())
    zero = Zero(model, cpu_world(COMM), OptimConfig(), level=1)
    state = zero.state_shards()
    assert state.kind == "zero"
    shards = state.buckets
    owned = sum(len(range(*s.layout.rank_range(COMM.rank))) for s in shards)
    assert owned == sum(s.layout.shard for s in shards)
    assert COMM.allreduce(owned) == sum(s.layout.padded for s in shards) >= n
    assert all(s.tensors["exp_avg"].numel() == s.layout.shard for s in shards)
