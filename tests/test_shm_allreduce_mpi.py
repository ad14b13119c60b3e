"""The shared-memory gradient allreduce over real ranks (run at 2 and 4), against MPI's
``Allreduce`` of the same numbers, with one node and with the ranks split into two
pretend nodes (the hierarchical path: node reduce-scatter, MPI between the nodes, node
allgather)."""

import time

import pytest
import torch
from mpi4py import MPI

from hpctrain.comm.shm_allreduce import SharedMemoryAllreduce, use_shared_memory
from hpctrain.comm.watchdog import wait_all
from hpctrain.config import OptimConfig
from hpctrain.errors import CommTimeout, ConfigError
from tests.helpers import cpu_world

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
NUMELS = [1, 3, 1000, 40_007]  # fewer elements than ranks, odd sizes, several slices


def _fill(arena: SharedMemoryAllreduce, epoch: int) -> list[torch.Tensor]:
    values = []
    for i, n in enumerate(NUMELS):
        g = torch.Generator().manual_seed(1000 * epoch + 10 * COMM.rank + i)
        values.append(torch.randn(n, generator=g))
        arena.flat(i).copy_(values[-1])
    return values


def _node_comm(nodes: str):
    if nodes == "one":
        return None
    return COMM.Split(COMM.rank // (COMM.size // 2), COMM.rank)  # two pretend nodes


@pytest.mark.parametrize("nodes", ["one", "two"])
def test_sums_equal_mpi_allreduce_and_are_the_same_bits_on_every_rank(nodes):
    arena = SharedMemoryAllreduce(COMM, NUMELS, node_comm=_node_comm(nodes))
    assert (arena.cross is not None) == (nodes == "two")
    for epoch in range(3):  # the same window, step after step
        if epoch == 1 and COMM.rank == COMM.size - 1:
            time.sleep(0.2)  # a late rank: nobody may read its bucket before it arrives
        values = _fill(arena, epoch)
        wait_all([arena.start(i) for i in range(len(NUMELS))], timeout=60, what="test")
        for i, v in enumerate(values):
            expected = v.clone()
            COMM.Allreduce(MPI.IN_PLACE, expected.numpy(), op=MPI.SUM)
            torch.testing.assert_close(arena.flat(i), expected, rtol=1e-6, atol=1e-6)
            assert len(set(COMM.allgather(arena.flat(i).numpy().tobytes()))) == 1
    arena.close()  # collective: only on success (a failure aborts all ranks)


def test_no_rank_finishes_before_every_peer_has_written_its_sums(monkeypatch):
    """The last rank writes its sums into the others' buckets late: they wait for them."""
    arena = SharedMemoryAllreduce(COMM, NUMELS)
    last = COMM.rank == COMM.size - 1
    expected = [v.clone() for v in _fill(arena, 0)]
    for e in expected:
        COMM.Allreduce(MPI.IN_PLACE, e.numpy(), op=MPI.SUM)
    if last:
        push = arena.push_own_slice
        monkeypatch.setattr(arena, "push_own_slice",
                            lambda bucket: (time.sleep(0.2), push(bucket)))
    wait_all([arena.start(i) for i in range(len(NUMELS))], timeout=60, what="test")
    for i, e in enumerate(expected):  # the late rank's slices are in every bucket
        torch.testing.assert_close(arena.flat(i), e, rtol=1e-6, atol=1e-6)
    if not last:  # done: the next step may write the buckets at once
        for i in range(len(NUMELS)):
            arena.flat(i).fill_(float("nan"))
    COMM.Barrier()
    if last:  # and nobody writes into a finished rank's bucket any more
        for i, e in enumerate(expected):
            torch.testing.assert_close(arena.flat(i), e, rtol=1e-6, atol=1e-6)
    arena.close()  # collective: only on success (a failure aborts all ranks)


def test_a_reduction_waits_for_every_rank_and_times_out_without_one():
    arena = SharedMemoryAllreduce(COMM, [100])
    if COMM.rank == 0:
        request = arena.start(0)
        assert not request.Test()  # the others have not arrived: nothing blocks
        with pytest.raises(CommTimeout, match="bucket 0"):
            wait_all([request], timeout=0.5, what="gradient reduction (bucket 0)")
    COMM.Barrier()
    arena.close()  # collective: only on success (a failure aborts all ranks)


def test_the_choice_is_collective_and_refuses_what_cannot_work():
    assert use_shared_memory("auto", COMM, "cpu", NUMELS)  # one node, several ranks
    assert not use_shared_memory("mpi", COMM, "cpu", NUMELS)
    assert not use_shared_memory("auto", COMM, "cuda:0", NUMELS)  # GPU: (CUDA-aware) MPI
    with pytest.raises(ConfigError, match="--comm.transport=auto or mpi"):
        use_shared_memory("shm", COMM, "cuda:0", NUMELS)
    assert not use_shared_memory("auto", MPI.COMM_SELF, "cpu", NUMELS)  # one rank
    with pytest.raises(ConfigError, match="/dev/shm has too little room"):
        use_shared_memory("shm", COMM, "cpu", [1 << 40])  # 4 TiB of gradients per rank


@pytest.mark.parametrize("nodes", ["one", "two"])
def test_data_parallel_gradients_through_shared_memory_equal_the_mpi_path(nodes):
    from hpctrain.model.gpt import GPT, GPTConfig
    from hpctrain.parallel.data_parallel import DataParallel

    world = cpu_world(COMM)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(COMM.rank))
    grads = {}
    for allreduce in ("shm", "mpi"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=32))
        dp = DataParallel(model, world, OptimConfig(), bucket_mb=0.01, first_bucket_mb=0.004,
                          allreduce=allreduce, node_comm=_node_comm(nodes))
        assert (dp.transport.name == "shm") == (allreduce == "shm")
        dp.prepare_for_backward(last_micro=True)
        (model(x, x) * dp.grad_scale).backward()
        dp.finish()
        grads[allreduce] = [b.flat.clone() for b in dp.buckets]
        dp.close()
    for shm, mpi in zip(grads["shm"], grads["mpi"]):
        torch.testing.assert_close(shm, mpi, rtol=1e-6, atol=1e-7)
        assert len(set(COMM.allgather(shm.numpy().tobytes()))) == 1
