"""``--comm.transport=xccl``: the engines' buckets and shards moved by a device
collective library through ``torch.distributed`` (gloo here: the CPU stands in for the
GPU and gloo for NCCL), against the single-process result, at 2 and 4 ranks.

Each layout gets the same checks as its MPI twin (``test_dp_mpi``, ``test_zero_mpi``,
``test_pipeline_mpi``): first-step reduced gradients and norm, every loss, the final
parameters (fp32), or the fp32 master weights to the bf16 bounds.
"""

import pytest
from mpi4py import MPI

from hpctrain.comm import device_collectives
from hpctrain.comm.xccl_transport import XcclTransport
from hpctrain.train.trainer import Trainer
from tests.helpers import (cpu_world, fit_against_reference, fit_bf16_against_reference,
                           tiny_config, two_ranks_suffice)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


@pytest.fixture(scope="module", autouse=True)
def device_library():
    """Leave the process group when this file is done: gloo's threads keep polling its
    sockets, which takes cores from the rest of the leg (4 ranks share 2 cores)."""
    yield
    COMM.Barrier()
    device_collectives.stop()


def _fit(mpi_dataset, shared_tmp, **overrides):
    cfg = tiny_config(mpi_dataset, shared_tmp, **{"parallel.bucket_mb": 0.02,
                                                  "parallel.first_bucket_mb": 0.005,
                                                  "parallel.micro_batches": 2, **overrides})
    trainer = Trainer(cfg, cpu_world(COMM, collectives="xccl"), verbose=False)
    assert trainer.world.collectives == "xccl"
    if trainer.grid.dp > 1:  # the gradients go through the library, not MPI
        assert isinstance(trainer.engine.world.transport, XcclTransport)
        assert trainer.engine.world.transport.name == "gloo"
    if cfg.train.dtype == "bf16":
        fit_bf16_against_reference(trainer, cfg)
    else:
        fit_against_reference(trainer, cfg, trainer.grid.dp_world.comm)
    return trainer


SHARDS_ONLY_AT_FOUR = two_ranks_suffice(
    "the library's reductions are the same calls at 4 ranks; ZeRO-3, whose parameter "
    "gathers change with the shard count, and the pipelines run at 4")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [pytest.param(0, marks=SHARDS_ONLY_AT_FOUR),
                                   pytest.param(1, marks=SHARDS_ONLY_AT_FOUR),
                                   pytest.param(2, marks=SHARDS_ONLY_AT_FOUR), 3])
def test_data_parallel_and_zero_over_the_device_library(mpi_dataset, shared_tmp, stage,
                                                        dtype):
    trainer = _fit(mpi_dataset, shared_tmp, **{"parallel.zero": stage, "train.dtype": dtype})
    assert trainer.engine.stats.reductions > 0


@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)])
def test_pipelines_over_the_device_library(mpi_dataset, shared_tmp, schedule, virtual):
    """pp=2 (at 4 ranks dp=2 x pp=2 with ZeRO-1): the data-parallel reductions run in
    the library's groups of each stage."""
    _fit(mpi_dataset, shared_tmp, **{
        "model.n_layer": 4, "parallel.pp": 2, "parallel.micro_batches": 4,
        "parallel.schedule": schedule, "parallel.virtual_stages": virtual,
        "parallel.zero": 1 if COMM.size >= 4 else 0, "train.max_iters": 6})
