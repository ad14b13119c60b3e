"""Expert parallelism's dispatch and combine over real MPI ranks against one process:
every rank routes random token copies (random counts per expert, zeros included: a rank
sending nothing to a peer, experts receiving nothing) to toy experts (one weight matrix
each, slices of one global (E, C, C) tensor), and its outputs and the gradients of its
copies and of its experts' weights equal those of every rank's copies run on every
expert in one process. The inputs of all ranks come from one seed, so each rank builds
the whole reference itself.

Transports: MPI on host memory, and on the fake device (staged through host buffers,
and handed over directly as to a GPU-aware MPI). The device library's (gloo):
``test_expert_dispatch_xccl_mpi.py``.
"""

import time

import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.fake_device import FakeAccelerator
from hpctrain.comm.gpu_aware import GPUAwareness
from hpctrain.errors import CommTimeout
from hpctrain.parallel.experts.alltoall import MPIAllToAll
from hpctrain.parallel.experts.dispatch import (ExpertParallelDispatch, LocalDispatch,
                                                dispatch_combine)
from tests.helpers import cpu_world, two_ranks_suffice

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
C = 8
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _counts(g: torch.Generator, source: int, n_experts: int, empty: str) -> torch.Tensor:
    """``empty``: "none" (every expert gets 1 to 4 copies: every block of the exchange
    is full, so regrouping by expert is never the identity), "some" (about 4 in 10
    zero), "source" (rank 0 sends nothing at all), "expert" (expert 1, rank 0's second
    or rank 1's first, receives nothing)."""
    counts = torch.randint(1, 5, (n_experts,), generator=g)
    if empty == "some":
        counts[torch.rand(n_experts, generator=g) < 0.4] = 0
    if empty == "source" and source == 0:
        counts.zero_()
    if empty == "expert":
        counts[1] = 0
    return counts


def _inputs(ep: int, n_experts: int, seed: int, empty: str):
    """The global weights, and every source rank's (routed, counts, output gradient)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(n_experts, C, C, generator=g) / C ** 0.5
    ranks = []
    for source in range(ep):
        counts = _counts(g, source, n_experts, empty)
        m = int(counts.sum())
        ranks.append((torch.randn(m, C, generator=g), counts, torch.randn(m, C, generator=g)))
    return weights, ranks


def _expert(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w)


def _reference(weights, ranks):
    """Every source's copies on every expert in one process: the outputs, the copies'
    gradients and the weights' gradient of sum(output * dout) over all sources."""
    w = weights.clone().requires_grad_()
    outs, xs, loss = [], [], 0.0
    for routed, counts, dout in ranks:
        x = routed.clone().requires_grad_()
        rows = torch.split(x, counts.tolist())
        out = torch.cat([_expert(r, w[e]) for e, r in enumerate(rows)])
        loss = loss + (out * dout).sum()
        outs.append(out.detach())
        xs.append(x)
    loss.backward()
    return outs, [x.grad for x in xs], w.grad


def _toy_experts(w_local: torch.Tensor):
    def experts(tokens, local_counts):
        assert len(local_counts) == w_local.shape[0] and sum(local_counts) == len(tokens)
        rows = torch.split(tokens, local_counts)
        return torch.cat([_expert(r, w_local[j]) for j, r in enumerate(rows)])
    return experts


def _check(dispatch, comm, per_rank: int = 2, seed: int = 0, empty: str = "none") -> None:
    ep, rank = comm.Get_size(), comm.Get_rank()
    n_experts = per_rank * ep
    weights, ranks = _inputs(ep, n_experts, seed, empty)
    outs, grads, dw = _reference(weights, ranks)
    routed, counts, dout = ranks[rank]
    x = routed.clone().requires_grad_()
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    w_local = weights[mine].clone().requires_grad_()
    out = dispatch(x, counts, _toy_experts(w_local))
    (out * dout).sum().backward()
    torch.testing.assert_close(out, outs[rank], **TOL, msg=lambda m: f"output, rank {rank}: {m}")
    torch.testing.assert_close(x.grad, grads[rank], **TOL,
                               msg=lambda m: f"token gradient, rank {rank}: {m}")
    torch.testing.assert_close(w_local.grad, dw[mine], **TOL,
                               msg=lambda m: f"expert weight gradient, rank {rank}: {m}")


@pytest.mark.parametrize("per_rank", [1, 2, 3])
@pytest.mark.parametrize("empty", ["none", "some", "source", "expert"])
def test_mpi_dispatch_equals_every_expert_in_one_process(per_rank, empty):
    """ep = the world (2 or 4), host memory; 1 to 3 experts per rank."""
    dispatch = ExpertParallelDispatch(MPIAllToAll(COMM, timeout=60.0))
    _check(dispatch, COMM, per_rank, seed=10 * per_rank + len(empty), empty=empty)


@pytest.mark.parametrize("aware", [False, True])
def test_fake_device_dispatch_stages_or_hands_over_after_the_event(aware):
    """The fake device: rows staged through host buffers (MPI not GPU-aware) or handed
    over directly, never before the event of their last write."""
    accel = FakeAccelerator()
    try:
        dispatch = ExpertParallelDispatch(MPIAllToAll(
            COMM, timeout=60.0, accel=accel, aware=GPUAwareness(aware, "test")))
        _check(dispatch, COMM, 2, seed=3, empty="expert")
        stats = accel.stats
        assert stats.unready_handoffs == 0 and stats.numpy_on_device == 0
        assert (stats.staged_bytes > 0) != aware
        assert (stats.direct_handoffs > 0) == aware
    finally:
        accel.close()


@pytest.mark.mpi(min_size=4)
def test_two_groups_side_by_side_each_over_its_own_communicator():
    """Two expert-parallel groups of 2 from 4 ranks, each with its own tokens: peers are
    ranks of the group's communicator, not of the world."""
    color = COMM.rank // 2
    sub = COMM.Split(color, COMM.rank)
    try:
        _check(ExpertParallelDispatch(MPIAllToAll(sub, timeout=60.0)), sub, 2, seed=20 + color)
    finally:
        sub.Free()


def test_of_world_picks_mpi_or_local_and_dispatch_combine_round_trips():
    world = cpu_world(COMM)
    try:
        dispatch = ExpertParallelDispatch.of_world(COMM, world)
        assert isinstance(dispatch.transport, MPIAllToAll)
        assert isinstance(ExpertParallelDispatch.of_world(MPI.COMM_SELF, world), LocalDispatch)
        _, ranks = _inputs(COMM.size, 2 * COMM.size, 5, "some")
        routed, counts, _ = ranks[COMM.rank]
        assert torch.equal(dispatch_combine(dispatch, routed, counts), routed)
    finally:
        world.close()


@pytest.mark.parametrize("aware", [None, False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_rows_of_any_dtype_travel_as_their_bytes(dtype, aware):
    """bf16 (no numpy type: its bit pattern) and float64 rows come back bit for bit
    through experts that return their tokens, with three columns per row: host memory
    (``aware`` None), or the fake device's staged or handed over directly."""
    accel = None if aware is None else FakeAccelerator()
    dispatch = ExpertParallelDispatch(MPIAllToAll(
        COMM, timeout=60.0, accel=accel,
        aware=GPUAwareness(bool(aware), "test")))
    g = torch.Generator().manual_seed(30 + COMM.rank)
    counts = torch.randint(0, 4, (2 * COMM.size,), generator=g)
    routed = torch.randn(int(counts.sum()), 3, generator=g).to(dtype)
    assert torch.equal(dispatch_combine(dispatch, routed, counts), routed)
    if accel is not None:
        assert accel.stats.unready_handoffs == 0
        accel.close()


@two_ranks_suffice("one late rank times out the same exchange whatever the group's size")
def test_a_late_rank_times_out_naming_the_count_exchange():
    """The last rank dispatches late: the others get ``CommTimeout`` naming the count
    exchange and ``--comm.timeout``; the late rank's exchange then completes (the others
    drive it from the barrier, the next collective in the same order everywhere)."""
    comm = COMM.Dup()
    try:
        dispatch = ExpertParallelDispatch(MPIAllToAll(comm, timeout=0.5))
        counts = torch.zeros(comm.size, dtype=torch.int64)
        if comm.rank != comm.size - 1:
            with pytest.raises(CommTimeout, match="exchanging the token counts.*--comm.timeout"):
                dispatch(torch.zeros(0, C), counts, lambda t, n: t)
        else:
            time.sleep(1.5)
            late = MPIAllToAll(comm, timeout=60.0)
            assert late.counts(counts.reshape(comm.size, 1)).sum() == 0
        comm.Barrier()
    finally:
        comm.Free()
