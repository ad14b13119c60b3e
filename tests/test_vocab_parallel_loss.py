"""The vocabulary-parallel cross-entropy (``parallel/tensor/cross_entropy.py``) in one
process (a group of one rank) against torch's, where it is easiest to get wrong: logits
far past exp's range, which only a log-sum-exp that subtracts the maximum survives, with
ignored tokens and a padded slice of the vocabulary."""

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from hpctrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.group import TensorParallelGroup
from tests.helpers import cpu_world


@pytest.mark.parametrize("scale,chunk", [(1.0, 0), (400.0, 0), (400.0, 5)])
def test_large_logits_give_torchs_loss_and_gradients(scale, chunk):
    """At scale 400 the logits reach about 1e3: exp overflows fp32 past 88."""
    group = TensorParallelGroup(MPI.COMM_SELF, cpu_world(MPI.COMM_SELF))
    gen = torch.Generator().manual_seed(0)
    vocab, padded, width = 13, 16, 8
    h = (scale * torch.randn(2, 6, width, generator=gen)).requires_grad_(True)
    weight = torch.randn(padded, width, generator=gen)
    weight[vocab:] = 0.0  # the padding rows: never a token
    weight.requires_grad_(True)
    targets = torch.randint(0, vocab, (2, 6), generator=gen)
    targets[0, 1] = -1  # ignored
    loss = vocab_parallel_cross_entropy(h, weight, targets, group, 0, vocab, chunk)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    w2 = weight.detach().clone().requires_grad_(True)
    logits = (h2 @ w2[:vocab].t()).view(-1, vocab)
    ref = F.cross_entropy(logits, targets.view(-1), ignore_index=-1)
    ref.backward()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-4, atol=1e-5 * scale)
    assert not weight.grad[vocab:].any()
