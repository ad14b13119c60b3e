"""Tensor parallelism inside a mixture of experts (``parallel/tensor/moe.py``) over real
MPI ranks, against the single-process result (first-step reduced gradients with the
slices joined, the norm, every loss, the final parameters; ``tests/helpers.py``): each
expert's hidden units split over tp, with and without sequence parallelism, with the
shared experts and their gate, with data parallelism and ZeRO, and with a pipeline.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import pytest
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, tiny_config

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
MOE = {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 4,
       "model.ffn_hidden": 48, "model.tie_embeddings": False, "model.vocab_multiple": 8,
       "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_hidden": 32,
       "model.moe_aux_loss": 0.1, "model.moe_z_loss": 0.01,
       "parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005}
"""A tiny Llama whose every block is a mixture of 4 experts (top-2), with strong
auxiliary losses so that a wrong share of their gradient shows."""


def _fit(data, out, **overrides):
    cfg = tiny_config(data, out, **{**MOE, **overrides})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_against_reference(trainer, cfg, trainer.grid.dp_world.comm)
    return trainer


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_experts_split_over_every_rank_match_single_process(mpi_dataset, shared_tmp,
                                                            sequence_parallel):
    """tp = the world: every expert's hidden units, and the shared experts', split; the
    router whole; two micro-batches."""
    tp = COMM.size
    trainer = _fit(mpi_dataset, shared_tmp, **{
        "parallel.tp": tp, "parallel.sequence_parallel": sequence_parallel,
        "parallel.micro_batches": 2, "model.moe_shared": 1, "model.moe_shared_gate": True})
    moe = trainer.model.h[0].mlp
    assert tuple(moe.experts.w_in.shape) == (4, 2 * 32 // tp, trainer.gpt_cfg.n_embd)
    assert tuple(moe.router.weight.shape) == (4, trainer.gpt_cfg.n_embd)


@pytest.mark.mpi(min_size=4)
def test_experts_split_with_data_parallelism_and_zero(mpi_dataset, shared_tmp):
    """dp = 2 x tp = 2, ZeRO-1, every other block a MoE block."""
    _fit(mpi_dataset, shared_tmp, **{"parallel.tp": 2, "parallel.zero": 1,
                                     "parallel.sequence_parallel": True,
                                     "model.moe_every": 2})


@pytest.mark.mpi(min_size=4)
def test_experts_split_in_a_pipeline(mpi_dataset, shared_tmp):
    """pp = 2 x tp = 2: each stage's MoE blocks split over its group; the balancing loss
    of the first stage's blocks reaches their routers without the last stage."""
    _fit(mpi_dataset, shared_tmp, **{"parallel.pp": 2, "parallel.tp": 2,
                                     "parallel.micro_batches": 2})
