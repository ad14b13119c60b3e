"""A mixture of experts in every pipeline schedule over real MPI ranks, against the
single-process run (first-step reduced gradients, the norm, every loss, the final
parameters; ``tests/helpers.py``): the balancing and z-losses of each stage's MoE blocks
reach their routers through ``AddAuxiliaryLoss`` (no path to the last stage), also when
the backward is split in two (zero bubble) or a block runs again (recomputation).

Run under ``mpiexec -n 2`` (``make test``; zbv and selective recomputation in ``make
test-slow``); four ranks would test nothing more.
"""

import pytest
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, tiny_config, two_ranks_suffice

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
MOE = {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 4,
       "model.ffn_hidden": 48, "model.tie_embeddings": False, "model.vocab_multiple": 8,
       "model.moe_experts": 4, "model.moe_top_k": 2, "model.moe_ffn_hidden": 32,
       "model.moe_aux_loss": 0.1, "model.moe_z_loss": 0.01, "model.n_layer": 4,
       "parallel.pp": 2, "parallel.micro_batches": 4}


@two_ranks_suffice("a stage's blocks and schedule are the same whatever dp is")
@pytest.mark.parametrize("schedule,extra", [
    ("zb-h1", {}), pytest.param("zbv", {}, marks=pytest.mark.slow, id="zbv"),
    pytest.param("1f1b", {"model.recompute": "selective"}, marks=pytest.mark.slow,
                 id="1f1b-selective"),
    ("interleaved", {"parallel.virtual_stages": 2, "model.recompute": "block"})],
    ids=["zb-h1", "zbv", "1f1b-selective", "interleaved-block"])
def test_moe_blocks_in_every_schedule_match_single_process(mpi_dataset, shared_tmp,
                                                           schedule, extra):
    cfg = tiny_config(mpi_dataset, shared_tmp, **{**MOE, **extra,
                                                 "parallel.schedule": schedule})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_against_reference(trainer, cfg, trainer.grid.dp_world.comm)
