"""Expert parallelism under ``--comm.transport=xccl``: the rows go by the device
library's ``all_to_all_single`` (``DeviceAllToAll`` over the group's ``experts`` process
group; gloo here, standing in for NCCL), the counts over MPI, against every expert in
one process, at 2 and 4 ranks; on the fake device, no rows reach the library before the
event of their last write.

What gloo cannot show: the stream ordering of a GPU's exchange.
"""

import pytest
import torch.distributed as dist
from mpi4py import MPI

from hpctrain.comm import device_collectives
from hpctrain.comm.fake_device import FakeAccelerator
from hpctrain.parallel.experts.device_alltoall import EXPERT_GROUP, DeviceAllToAll
from hpctrain.parallel.experts.dispatch import ExpertParallelDispatch
from tests.helpers import cpu_world
from tests.test_expert_dispatch_mpi import _check

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def world():
    """The device library (gloo) once for the file, with the world's ``experts`` group;
    left when the file is done (gloo's threads keep polling its sockets)."""
    w = cpu_world(COMM, collectives="xccl")
    device_collectives.make_groups([list(device_collectives.world_ranks(COMM))], EXPERT_GROUP)
    yield w
    COMM.Barrier()
    device_collectives.stop()
    w.close()


@pytest.mark.parametrize("per_rank", [1, 2])
@pytest.mark.parametrize("empty", ["none", "some", "source", "expert"])
def test_device_library_dispatch_equals_every_expert_in_one_process(world, per_rank, empty):
    dispatch = ExpertParallelDispatch.of_world(COMM, world)
    assert isinstance(dispatch.transport, DeviceAllToAll)
    assert dist.get_backend(dispatch.transport.group) == "gloo"
    _check(dispatch, COMM, per_rank, seed=40 + 10 * per_rank + len(empty), empty=empty)


def test_the_library_gets_fake_device_rows_only_after_their_event(world):
    accel = FakeAccelerator()
    try:
        dispatch = ExpertParallelDispatch(DeviceAllToAll(COMM, timeout=60.0, accel=accel))
        _check(dispatch, COMM, 2, seed=7, empty="expert")
        assert accel.stats.direct_handoffs > 0
        assert accel.stats.unready_handoffs == 0 and accel.stats.staged_bytes == 0
    finally:
        accel.close()
