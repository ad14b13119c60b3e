"""Expert parallelism (``--parallel.ep``) in training, over real MPI ranks, against the
single-process run: the first step's reduced gradients (the experts' slices joined over
the expert group) and norm, every loss and the final parameters (``tests/helpers.py``).
Each rank holds E/ep experts of every MoE layer, token copies reach them by an
all-to-all, the experts' gradients are reduced over the ranks holding the same experts
and the rest over every replica.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import pytest
import torch
from mpi4py import MPI

from hpctrain.model.common.moe import moe_layers
from hpctrain.parallel.experts.dispatch import ExpertParallelDispatch
from hpctrain.train.trainer import Trainer
from tests.helpers import (LLAMA, cpu_world, fit_against_reference, fit_bf16_against_reference,
                           tiny_config, two_ranks_suffice)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
MOE = {**LLAMA, "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_aux_loss": 0.01,
       "model.moe_z_loss": 0.001, "parallel.bucket_mb": 0.02,
       "parallel.first_bucket_mb": 0.005}
"""A tiny Llama whose blocks are MoE blocks of 4 experts, 2 per token (dropless), with
both auxiliary losses; small buckets, so that several are reduced per group."""


def _config(data, out, ep, **overrides):
    return tiny_config(data, out, **{**MOE, "parallel.ep": ep, **overrides})


def _trainer(cfg):
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    grid, ep = trainer.grid, cfg.parallel.ep
    assert (grid.ep, grid.ep_comm.size) == (ep, ep)
    layers = moe_layers(trainer.model)
    assert layers, "the model has no MoE layer"
    for layer in layers:
        assert layer.experts.n_experts == cfg.model.moe_experts // ep
        assert layer.experts.first == grid.ep_index * layer.experts.n_experts
        assert isinstance(layer.dispatch, ExpertParallelDispatch) == (ep > 1)
    return trainer


def _fit(cfg):
    """Against the reference; parameters are compared on the ranks holding the same
    experts (the dense ones are the same on every replica: checked by the whole state)."""
    trainer = _trainer(cfg)
    return fit_against_reference(trainer, cfg, trainer.grid.expert_world.comm)


def test_expert_parallel_over_every_rank_matches_single_process(mpi_dataset, shared_tmp):
    """ep = the world (2 or 4): each rank holds 2 or 1 of the 4 experts."""
    _fit(_config(mpi_dataset, shared_tmp, COMM.size))


@two_ranks_suffice("one micro-batch count is enough; ep at 4 is the test above")
def test_expert_parallel_with_micro_batches(mpi_dataset, shared_tmp):
    """Two micro-batches: the balancing loss of each is scaled as the training loss."""
    _fit(_config(mpi_dataset, shared_tmp, 2, **{"parallel.micro_batches": 2}))


@pytest.mark.mpi(min_size=4)
def test_expert_parallel_inside_data_parallel(mpi_dataset, shared_tmp):
    """ep = 2 x dp = 2: experts reduced over the 2 ranks holding the same ones, the rest
    over all 4."""
    _fit(_config(mpi_dataset, shared_tmp, 2))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_expert_parallel_with_zero(mpi_dataset, shared_tmp, zero):
    """ZeRO levels: the experts' buckets sharded over their holders, the rest over every
    replica (at 2 ranks ep = 2 leaves the experts unsharded)."""
    _fit(_config(mpi_dataset, shared_tmp, 2, **{"parallel.zero": zero}))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("zero", [0, 1])
def test_expert_parallel_with_pipeline(mpi_dataset, shared_tmp, zero):
    """ep = 2 inside each of pp = 2 stages (dp = 2), replicated and ZeRO-1."""
    _fit(_config(mpi_dataset, shared_tmp, 2, **{"parallel.pp": 2, "parallel.zero": zero,
                                                 "parallel.micro_batches": 2}))


@two_ranks_suffice("bf16 rounding is checked per engine, not per group size")
@pytest.mark.parametrize("zero", [0, 1])
def test_expert_parallel_in_bf16(mpi_dataset, shared_tmp, zero):
    cfg = _config(mpi_dataset, shared_tmp, 2, **{"train.dtype": "bf16",
                                                  "parallel.zero": zero})
    fit_bf16_against_reference(_trainer(cfg), cfg)


@two_ranks_suffice("no expert parallelism: plain data parallelism and pipelines")
@pytest.mark.parametrize("layout", ["dp", "pp"])
def test_moe_without_expert_parallelism_matches_single_process(mpi_dataset, shared_tmp,
                                                               layout):
    """Every rank holds every expert: dp = 2, or pp = 2 (two micro-batches)."""
    extra = {"parallel.pp": 2, "parallel.micro_batches": 2} if layout == "pp" else {}
    _fit(_config(mpi_dataset, shared_tmp, 1, **extra))


@pytest.mark.mpi(min_size=4)
def test_expert_groups_are_consecutive_replicas():
    """At 4 ranks (dp = 4), ep = 2: replicas {0, 1} and {2, 3} each hold every expert;
    the ranks holding the same experts are {0, 2} and {1, 3}."""
    from hpctrain.comm.grid import ProcessGrid

    grid = ProcessGrid.create(cpu_world(COMM), ep=2)
    try:
        assert (grid.dp, grid.ep, grid.ep_index) == (4, 2, grid.dp_index % 2)
        ep_members = sorted(grid.ep_comm.allgather(grid.dp_index))
        assert ep_members == [grid.dp_index // 2 * 2, grid.dp_index // 2 * 2 + 1]
        same = sorted(grid.expert_world.comm.allgather(grid.dp_index))
        assert same == [grid.dp_index % 2, grid.dp_index % 2 + 2]
        assert grid.expert_world.size == 2
    finally:
        grid.close()
