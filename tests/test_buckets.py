"""Bucket layout and gradient views, in one process (MPI tests cover the reduction)."""

import torch
from mpi4py import MPI

from hpctrain.config import OptimConfig
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.data_parallel import DataParallel, plan_buckets
from hpctrain.sizes import MiB
from tests.helpers import cpu_world


def test_plan_respects_caps_and_keeps_order():
    numels = [10, 20, 300, 5, 5, 1000, 1]
    groups = plan_buckets(numels, elem_bytes=4, cap_bytes=400 * 4, first_cap_bytes=25 * 4)
    assert groups == [[0], [1, 2, 3, 4], [5], [6]]
    assert [i for g in groups for i in g] == list(range(len(numels)))
    for k, g in enumerate(groups):
        size = sum(numels[i] for i in g) * 4
        cap = 25 * 4 if k == 0 else 400 * 4
        assert size <= cap or len(g) == 1  # only a lone oversized tensor exceeds its cap


def test_single_bucket_when_everything_fits():
    assert plan_buckets([1, 2, 3], 4, 1 << 20, 1 << 20) == [[0, 1, 2]]
    assert plan_buckets([], 4, 10, 10) == []


def _dp(bucket_mb=0.05, first_bucket_mb=0.01):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    world = cpu_world(MPI.COMM_SELF)
    return model, DataParallel(model, world, OptimConfig(), bucket_mb=bucket_mb,
                               first_bucket_mb=first_bucket_mb)


def test_buckets_follow_reverse_parameter_order_with_a_small_first_bucket():
    model, dp = _dp()
    flat_order = [p for b in dp.buckets for p in b.params]
    assert flat_order == list(model.parameters())[::-1]
    assert dp.buckets[0].nbytes <= 0.01 * MiB or len(dp.buckets[0].params) == 1
    assert all(b.nbytes <= 0.05 * MiB or len(b.params) == 1 for b in dp.buckets[1:])
    assert len(dp.buckets) > 3


def test_grads_are_views_into_the_flat_buffer():
    model, dp = _dp()
    x = torch.randint(0, 64, (2, 16))
    dp.prepare_for_backward(last_micro=True)
    model(x, x).backward()
    dp.finish()
    for b in dp.buckets:
        offset = 0
        for p in b.params:
            assert p.grad.data_ptr() == b.flat[offset:].data_ptr()  # aliases, no copy
            offset += p.numel()
        assert torch.equal(b.flat, torch.cat([p.grad.reshape(-1) for p in b.params]))
    assert any(b.flat.abs().sum() > 0 for b in dp.buckets)
    dp.zero_grad()
    assert all(b.flat.abs().sum() == 0 for b in dp.buckets)
    for p in model.parameters():  # even after someone drops the grads, zero_grad rebinds
        p.grad = None
    dp.zero_grad()
    assert all(p.grad is not None for p in model.parameters())


def test_gradient_accumulation_sums_into_the_views():
    model, dp = _dp()
    x1, x2 = torch.randint(0, 64, (2, 2, 16))
    dp.prepare_for_backward(last_micro=False)
    model(x1, x1).backward()
    dp.prepare_for_backward(last_micro=True)
    model(x2, x2).backward()
    dp.finish()
    accumulated = [p.grad.clone() for p in model.parameters()]
    ref = GPT(model.cfg)
    ref.load_state_dict(model.state_dict())
    (ref(x1, x1) + ref(x2, x2)).backward()
    for a, p in zip(accumulated, ref.parameters()):
        torch.testing.assert_close(a, p.grad)
