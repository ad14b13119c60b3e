"""Ring attention over real MPI ranks against the whole sequence's causal attention in
one process: on every rank, the output and the gradients of q, k and v equal those of
``F.scaled_dot_product_attention(..., is_causal=True)`` on the whole sequence,
restricted to the tokens the rank holds (chunks r and 2 cp - 1 - r, written out here
rather than taken from ``chunks.py``).

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

from hpctrain.errors import CommTimeout
from hpctrain.parallel.context import chunks
from hpctrain.parallel.context.ring import MPIRing, Ring
from hpctrain.parallel.context.ring_attention import ring_attention
from tests.helpers import cpu_world

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
B, NH, HS = 2, 4, 16
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _held(rank: int, cp: int, T: int) -> torch.Tensor:
    """The load-balanced layout, independent of ``chunks.py``: the sequence in 2 cp
    pieces of c tokens, rank r holding pieces r and 2 cp - 1 - r."""
    c = T // (2 * cp)
    return torch.tensor([*range(rank * c, (rank + 1) * c),
                         *range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def _whole(T: int, nkv: int, seed: int):
    """q, k, v and the output gradient of the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, NH, T, HS), (B, nkv, T, HS), (B, nkv, T, HS), (B, NH, T, HS)]
    return [torch.randn(s, generator=g) for s in shapes]


def _check_ring_against_whole(comm, T: int, nkv: int, seed: int, ring=None) -> None:
    """``ring``: over ``comm`` (default: ``MPIRing``)."""
    cp, rank = comm.Get_size(), comm.Get_rank()
    q, k, v, dout = _whole(T, nkv, seed)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    expected.backward(dout)

    idx = _held(rank, cp, T)
    assert torch.equal(chunks.positions(rank, cp, T), idx)
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, ring or MPIRing(comm, timeout=60.0))
    out.backward(dout[:, :, idx])

    torch.testing.assert_close(out, expected[:, :, idx], **TOL)
    for name, local, whole in zip("qkv", mine, ref):
        torch.testing.assert_close(local.grad, whole.grad[:, :, idx], **TOL,
                                   msg=lambda m, name=name: f"d{name} on rank {rank}: {m}")


@pytest.mark.parametrize("T", [64, 128])
@pytest.mark.parametrize("nkv", [4, 2])
def test_ring_attention_over_every_rank_equals_causal_attention(T, nkv):
    """cp = the world (2 or 4); 4 key/value heads, or 2 for 4 query heads
    (grouped-query attention, the blocks travelling with 2 heads)."""
    _check_ring_against_whole(COMM, T, nkv, seed=T + nkv)


@pytest.mark.mpi(min_size=4)
def test_two_rings_side_by_side_each_over_its_own_communicator():
    """Two groups of 2 split from 4 ranks, each with its own sequence: ring neighbours
    are ranks of the group's communicator, not of the world."""
    color = COMM.rank // 2
    sub = COMM.Split(color, COMM.rank)
    try:
        _check_ring_against_whole(sub, 64, 2, seed=100 + color)
    finally:
        sub.Free()


def test_bf16_inputs_give_bf16_results_close_to_fp32():
    """The blocks are computed and merged in fp32 whatever the inputs' dtype; inputs and
    outputs keep theirs (bf16 on the wire)."""
    cp, rank = COMM.size, COMM.rank
    q, k, v, dout = _whole(64, 2, seed=7)
    idx = _held(rank, cp, 64)
    mine = [t[:, :, idx].bfloat16().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, Ring.of_world(COMM, cpu_world(COMM)))
    out.backward(dout[:, :, idx].bfloat16())
    assert out.dtype == torch.bfloat16
    assert all(t.grad.dtype == torch.bfloat16 for t in mine)
    ref = [t.bfloat16().float()[:, :, idx] for t in (q, k, v)]
    fp32 = ring_attention(*ref, MPIRing(COMM, timeout=60.0))
    torch.testing.assert_close(out.float(), fp32, rtol=0, atol=2e-2)


def test_a_shift_waits_with_a_deadline_that_names_the_block_and_the_option():
    """The last rank arrives late: rank 0, which receives from it, gets ``CommTimeout``
    naming the transfer, the rank it waited for and ``--comm.timeout``; once the last
    rank posts its shift, the same transfer completes with its tensor."""
    comm = COMM.Dup()  # the late messages cannot meet another test's
    ring = MPIRing(comm, timeout=0.5)
    last = comm.rank == comm.size - 1
    mine = torch.full((3,), float(comm.rank))
    transfer = None if last else ring.shift(mine, +1, 7, "test block")
    if comm.rank == 0:
        with pytest.raises(CommTimeout, match=(r"context-parallel ring: test block from "
                                               rf"rank {comm.size - 1} .*--comm.timeout")):
            transfer.wait()
    comm.Barrier()
    if last:
        transfer = ring.shift(mine, +1, 7, "test block")
    received = transfer.wait()
    assert torch.equal(received, torch.full((3,), float((comm.rank - 1) % comm.size)))
    comm.Barrier()
    comm.Free()
