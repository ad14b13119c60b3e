"""Context parallelism under ``--comm.transport=xccl``: the ring's key/value blocks and
their gradients go by the device library's point-to-point (``DeviceRing``:
``torch.distributed.batch_isend_irecv`` over the group's ``ring`` process group; gloo
here, the CPU standing in for the GPU and gloo for NCCL), against whole-sequence causal
attention and the single-process run, at 2 and 4 ranks.

What gloo cannot show: NCCL matching a pair's messages by their order rather than by tag
(gloo has tags), and the stream ordering of a GPU's transfers.
"""

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpctrain.comm import device_collectives
from hpctrain.errors import CommTimeout
from hpctrain.parallel.context.apply import RingContext
from hpctrain.parallel.context.ring import RING_GROUP, DeviceRing
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, tiny_config
from tests.test_context_parallel_mpi import ARCHS, SMALL_BUCKETS
from tests.test_ring_attention_mpi import _check_ring_against_whole

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


@pytest.fixture(scope="module", autouse=True)
def device_library():
    """Start the device library (gloo) once for the file; leave it when the file is done
    (gloo's threads keep polling its sockets, taking cores from the rest of the leg)."""
    cpu_world(COMM, collectives="xccl")
    yield
    COMM.Barrier()
    device_collectives.stop()


def _full(value: int) -> torch.Tensor:
    return torch.full((3,), float(value))


def _device_ring(comm, timeout: float = 60.0) -> DeviceRing:
    """A ring over ``comm`` on the library: its group made first, by every world rank."""
    device_collectives.make_groups([list(device_collectives.world_ranks(comm))], RING_GROUP)
    return DeviceRing(comm, timeout=timeout)


@pytest.mark.parametrize("nkv", [4, 2])
def test_ring_attention_over_the_device_library_equals_causal_attention(nkv):
    """cp = the world (2 or 4); output, dq, dk and dv on every rank."""
    ring = _device_ring(COMM)
    assert dist.get_backend(ring.group) == "gloo"
    _check_ring_against_whole(COMM, 64, nkv, seed=200 + nkv, ring=ring)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_context_parallel_over_the_device_library_matches_single_process(mpi_dataset,
                                                                         shared_tmp, arch):
    """cp = 2 (dp = 2 at 4 ranks: the gradients over dp x cp go through the library
    too): GPT-2's learned positions, Llama's rotary ones with grouped-query attention."""
    cfg = tiny_config(mpi_dataset, shared_tmp, **{"parallel.cp": 2, **SMALL_BUCKETS,
                                                  "parallel.micro_batches": 2, **ARCHS[arch]})
    trainer = Trainer(cfg, cpu_world(COMM, collectives="xccl"), verbose=False)
    rings = {id(m.context.ring): m.context.ring for m in trainer.model.modules()
             if isinstance(getattr(m, "context", None), RingContext)}
    assert rings and all(isinstance(r, DeviceRing) for r in rings.values()), \
        "the blocks do not go by the device library"
    assert all(dist.get_backend(r.group) == "gloo" for r in rings.values())
    fit_against_reference(trainer, cfg, trainer.grid.dp_world.comm)


def test_a_late_rank_times_out_naming_the_ring_block_and_rank():
    """The last rank does not post its shift: rank 0, which receives from it, gets
    ``CommTimeout`` naming the ring, the transfer, the rank and ``--comm.timeout``.
    gloo closes the connection a timed-out wait was on, so the ring ends there (the job
    would abort); the one message still in flight (to the late rank) is drained."""
    comm = COMM.Dup()  # a group of its own: the closed connection stays in it
    ring = _device_ring(comm, timeout=0.5)
    last = comm.rank == comm.size - 1
    transfer = None if last else ring.shift(_full(comm.rank), +1, 7, "test block")
    if comm.rank == 0:
        with pytest.raises(CommTimeout, match=(r"context-parallel ring: test block from "
                                               rf"rank {comm.size - 1} .*--comm.timeout")):
            transfer.wait()
    elif not last:
        assert transfer.wait().tolist() == [float(comm.rank - 1)] * 3
    if last and comm.size > 2:
        got = _full(-1)
        dist.recv(got, dist.get_global_rank(ring.group, comm.rank - 1), group=ring.group, tag=7)
        assert got.tolist() == [float(comm.rank - 1)] * 3
    comm.Barrier()
    comm.Free()
