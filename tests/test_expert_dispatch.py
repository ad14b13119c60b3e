"""The index arithmetic of expert-parallel dispatch and combine (``permute.py``), and
the local dispatch, in one process."""

import pytest
import torch

from hpctrain.parallel.experts import permute
from hpctrain.parallel.experts.dispatch import LocalDispatch, dispatch_combine


def test_per_peer_splits_the_global_counts_by_the_peers_experts():
    counts = torch.tensor([1, 0, 2, 3, 0, 4])
    table = permute.per_peer(counts, 3)
    assert table.tolist() == [[1, 0], [2, 3], [0, 4]]
    assert permute.rows_per_peer(table) == [1, 5, 4]
    assert permute.rows_per_expert(table) == [3, 7]


def test_per_peer_refuses_experts_that_do_not_divide_over_the_ranks():
    with pytest.raises(ValueError, match="multiple of ep"):
        permute.per_peer(torch.tensor([1, 2, 3]), 2)


def _labelled(table):
    """Source-major rows labelled (source, expert, i), as they arrive."""
    return [(s, j, i) for s in range(table.shape[0]) for j in range(table.shape[1])
            for i in range(int(table[s, j]))]


@pytest.mark.parametrize("table", [[[2, 1], [0, 3]], [[0, 0], [0, 0]], [[1, 0, 2]],
                                   [[0, 2], [1, 0], [3, 0]]])
def test_expert_major_order_groups_arrivals_by_expert_then_source(table):
    table = torch.tensor(table)
    rows = _labelled(table)
    order = permute.expert_major_order(table)
    grouped = [rows[i] for i in order.tolist()]
    assert grouped == sorted(rows, key=lambda r: (r[1], r[0], r[2]))
    assert [r[1] for r in grouped] == [j for j, n in enumerate(permute.rows_per_expert(table))
                                       for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_expert_major_order_of_random_tables(seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 4, (1 + seed % 4, 1 + seed % 3), generator=g)
    rows = _labelled(table)
    grouped = [rows[i] for i in permute.expert_major_order(table).tolist()]
    assert grouped == sorted(rows, key=lambda r: (r[1], r[0], r[2]))


def test_inverse_undoes_the_order():
    table = torch.tensor([[2, 1], [0, 3], [1, 1]])
    order = permute.expert_major_order(table)
    x = torch.arange(int(table.sum()))
    assert torch.equal(x[order][permute.inverse(order)], x)
    assert not torch.equal(order, torch.arange(order.numel()))  # a real permutation


def test_local_dispatch_hands_the_counts_and_checks_their_sum():
    seen = []

    def experts(tokens, local_counts):
        seen.append(local_counts)
        return tokens * 2

    x = torch.randn(5, 3)
    torch.testing.assert_close(LocalDispatch()(x, torch.tensor([2, 0, 3]), experts), x * 2)
    assert seen == [[2, 0, 3]]
    assert torch.equal(dispatch_combine(LocalDispatch(), x, torch.tensor([5, 0])), x)
    with pytest.raises(ValueError, match="sum to 4 but 5 token copies"):
        LocalDispatch()(x, torch.tensor([4, 0]), experts)
