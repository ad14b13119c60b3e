"""The test-only third family (``tests/third_family.py``: GPT-2 with a three-layer
gated MLP) at dp=2, tp=2 and pp=2 over real MPI ranks, against the single-process run
(first-step gradients and norm, every loss, the final parameters; ``tests/helpers.py``).
Nothing under ``parallel/`` knows the family: its plan says what to split, cut and tie.

Run under ``mpiexec -n 2`` with pytest-mpi (``make test``'s 2-rank leg).
"""

import pytest
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, tiny_config, two_ranks_suffice
from tests.third_family import ARCH

pytestmark = [pytest.mark.mpi(min_size=2),
              two_ranks_suffice("each dimension at 2 is what the family must pass; the "
                                "built-in families cover the 4-rank combinations")]
COMM = MPI.COMM_WORLD
THIRD = {"model.arch": ARCH, "model.n_head": 4, "model.vocab_multiple": 8,
         "model.bias": True, "parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005}


@pytest.mark.parametrize("layout", [
    {"parallel.micro_batches": 2},
    {"parallel.zero": 3},
    {"parallel.tp": 2, "model.bias": False},
    {"parallel.tp": 2, "parallel.sequence_parallel": True, "model.tie_embeddings": False},
    {"parallel.pp": 2, "model.n_layer": 4, "parallel.micro_batches": 4},
    {"parallel.pp": 2, "model.n_layer": 4, "parallel.micro_batches": 4,
     "parallel.schedule": "zbv", "model.tie_embeddings": False},
], ids=["dp", "zero3", "tp", "tp-sp-untied", "pp-1f1b", "pp-zbv-untied"])
def test_third_family_matches_single_process(mpi_dataset, shared_tmp, layout):
    cfg = tiny_config(mpi_dataset, shared_tmp, **{**THIRD, **layout})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert trainer.gpt_cfg.arch == ARCH
    grid = trainer.grid
    replicas = grid.dp_world.comm if grid.pp > 1 or grid.tp > 1 else COMM
    fit_against_reference(trainer, cfg, replicas)
    if grid.tp > 1:
        mlp = trainer.model.h[0].mlp
        assert mlp.gate_proj.weight.shape[0] == trainer.gpt_cfg.ffn_hidden // 2
        assert mlp.down_proj.weight.shape[1] == trainer.gpt_cfg.ffn_hidden // 2
