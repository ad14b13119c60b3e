"""Selective recomputation and every N-th block recomputed, over real MPI ranks, against
the single-process run without recomputation (``tests/reference.py`` turns it off): the
first step's reduced gradients and norm, every loss, the final parameters
(``tests/helpers.py``). ZeRO-3 gathers a block's parameters again before the
recomputation reads them; tensor parallelism's collectives run again inside it, in the
same order on every rank; pipeline stages recompute between other micro-batches' passes.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import pytest
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import LLAMA, cpu_world, fit_against_reference, tiny_config, two_ranks_suffice

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
SMALL = {"model.n_head": 4, "model.vocab_multiple": 8, "parallel.bucket_mb": 0.02,
         "parallel.first_bucket_mb": 0.005, "train.max_iters": 4}
SELECTIVE = {"model.recompute": "selective", "model.recompute_every": 2}
"""Blocks 1, 3, ... wholly recomputed, the others selectively: both kinds in one run."""


def _fit(data, out, arch, **overrides):
    family = {**LLAMA, "model.n_kv_head": 2} if arch == "llama" else {"model.bias": True}
    cfg = tiny_config(data, out, **{**SMALL, **family, **SELECTIVE, "model.n_layer": 4,
                                    **overrides})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    blocks = trainer.model.h
    modes = {int(i): b.recompute for i, b in
             (blocks.items() if hasattr(blocks, "items") else enumerate(blocks))}
    assert modes and all(m == ("block" if i % 2 else "selective") for i, m in modes.items())
    fit_against_reference(trainer, cfg, trainer.grid.dp_world.comm)
    return trainer


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_selective_under_zero3_matches_single_process(mpi_dataset, shared_tmp, arch):
    _fit(mpi_dataset, shared_tmp, arch, **{"parallel.zero": 3,
                                          "parallel.micro_batches": 2})


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_selective_with_tensor_and_sequence_parallelism_matches_single_process(
        mpi_dataset, shared_tmp, arch):
    """tp=2 (x dp=2 at 4 ranks) with sequence parallelism."""
    trainer = _fit(mpi_dataset, shared_tmp, arch, **{"parallel.tp": 2,
                                                     "parallel.sequence_parallel": True})
    assert trainer.grid.tp == 2


ZERO_BUBBLE_AT_TWO = two_ranks_suffice("the B and W passes recompute a block per stage; "
                                       "1f1b runs the dp=2 x pp=2 grid")


@pytest.mark.parametrize("arch, schedule", [
    ("gpt", "1f1b"), ("llama", "1f1b"),
    pytest.param("llama", "zb-h1", marks=ZERO_BUBBLE_AT_TWO),
    pytest.param("gpt", "zbv", marks=ZERO_BUBBLE_AT_TWO)])
def test_selective_in_pipeline_stages_matches_single_process(mpi_dataset, shared_tmp, arch,
                                                             schedule):
    """pp=2 (x dp=2 at 4 ranks) over 4 micro-batches; the zero-bubble schedules' B and W
    passes each recompute a block, the second from the same kept outputs."""
    trainer = _fit(mpi_dataset, shared_tmp, arch, **{"parallel.pp": 2,
                                                     "parallel.micro_batches": 4,
                                                     "parallel.schedule": schedule})
    assert trainer.grid.pp == 2


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel.zero": 3, "parallel.micro_batches": 2},
                                    {"parallel.tp": 2, "parallel.sequence_parallel": True}])
def test_compiled_selective_blocks_match_single_process(mpi_dataset, shared_tmp, layout):
    """``--train.compile``: each selective block compiled with its policy (ZeRO-3's hooks
    and tensor parallelism's collectives outside the compiled code)."""
    _fit(mpi_dataset, shared_tmp, "llama", **{"train.compile": True, **layout})
