"""Expert parallelism under ``--comm.transport=xccl`` (gloo standing in for NCCL): the
tokens' all-to-all over each expert group's ``experts`` process group, the experts'
gradients over the process groups of the ranks holding the same experts, against the
single-process run at 2 and 4 ranks (the checks of ``test_expert_parallel_mpi.py``).
"""

import pytest
from mpi4py import MPI

from hpctrain.comm import device_collectives
from hpctrain.comm.xccl_transport import XcclTransport
from hpctrain.model.common.moe import moe_layers
from hpctrain.parallel.experts.device_alltoall import DeviceAllToAll
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, tiny_config
from tests.test_expert_parallel_mpi import MOE

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


@pytest.fixture(scope="module", autouse=True)
def device_library():
    """Leave the process group when this file is done (gloo's threads keep polling)."""
    yield
    COMM.Barrier()
    device_collectives.stop()


@pytest.mark.parametrize("zero", [0, 3])
def test_expert_parallel_over_the_device_library(mpi_dataset, shared_tmp, zero):
    """ep = 2 (x dp = 2 at 4 ranks, where ZeRO-3 shards the experts over 2 ranks)."""
    cfg = tiny_config(mpi_dataset, shared_tmp, **{**MOE, "parallel.ep": 2,
                                                  "parallel.zero": zero})
    trainer = Trainer(cfg, cpu_world(COMM, collectives="xccl"), verbose=False)
    assert isinstance(trainer.engine.world.transport, XcclTransport)
    for layer in moe_layers(trainer.model):
        assert isinstance(layer.dispatch.transport, DeviceAllToAll)
    fit_against_reference(trainer, cfg, trainer.grid.expert_world.comm)
