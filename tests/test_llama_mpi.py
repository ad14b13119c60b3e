"""The Llama family (``--model.arch=llama``) in every parallel mode, over real MPI ranks,
against the single-process result: the same checks as GPT-2's (first-step reduced
gradients and norm, every loss, the final parameters; ``tests/helpers.py``).

The model: rotary positions, RMSNorm, SwiGLU, 4 query heads sharing 2 key/value heads
(grouped-query attention), an untied head (the pipeline's last stage owns it) and a
padded vocabulary. One case ties the head, so the pipeline's tied-embedding exchange runs
with this architecture too, and one computes the loss in chunks.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import (cpu_world, fit_against_reference, fit_bf16_against_reference,
                           tiny_config, two_ranks_suffice)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
LLAMA = {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 2,
         "model.ffn_hidden": 48, "model.tie_embeddings": False, "model.rope_theta": 500.0,
         "model.vocab_multiple": 8,
         "parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005}
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved", 2)]


def _config(data, out, **overrides):
    return tiny_config(data, out, **{**LLAMA, **overrides})


def _pipeline(data, out, pp, schedule="1f1b", virtual=1, **overrides):
    return _config(data, out, **{"model.n_layer": 8, "parallel.pp": pp,
                                 "parallel.micro_batches": 4, "parallel.schedule": schedule,
                                 "parallel.virtual_stages": virtual, "train.max_iters": 6,
                                 **overrides})


def _fit(cfg):
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    assert trainer.gpt_cfg.arch == "llama" and trainer.gpt_cfg.n_kv_head == 2
    grid = trainer.grid
    replicas = grid.dp_world.comm if grid.pp > 1 else COMM
    return trainer, fit_against_reference(trainer, cfg, replicas)


@two_ranks_suffice("Llama's layers meet data parallelism and ZeRO as GPT-2's do; "
                   "test_dp_mpi and test_zero_mpi run them at dp=4")
@pytest.mark.parametrize("micro_batches,allreduce", [(1, "shm"), (2, "mpi")])
def test_llama_data_parallel_matches_single_process(mpi_dataset, shared_tmp, micro_batches,
                                                    allreduce):
    _fit(_config(mpi_dataset, shared_tmp, **{"parallel.micro_batches": micro_batches,
                                             "comm.transport": allreduce}))


@two_ranks_suffice("Llama's layers meet data parallelism and ZeRO as GPT-2's do; "
                   "test_dp_mpi and test_zero_mpi run them at dp=4")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_zero_matches_single_process(mpi_dataset, shared_tmp, stage):
    _fit(_config(mpi_dataset, shared_tmp, **{"parallel.zero": stage,
                                             "parallel.micro_batches": 2}))


@two_ranks_suffice("Llama's layers meet data parallelism and ZeRO as GPT-2's do; "
                   "test_dp_mpi and test_zero_mpi run them at dp=4")
def test_llama_zero3_with_chunked_loss_and_recompute(mpi_dataset, shared_tmp):
    """ZeRO-3 frees each block's parameters after its forward; recomputation and the
    chunked head must still find them in backward."""
    _fit(_config(mpi_dataset, shared_tmp, **{"parallel.zero": 3, "model.loss_chunk": 24,
                                             "model.recompute": "block"}))


@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_llama_pipeline_matches_single_process(mpi_dataset, shared_tmp, pp, schedule,
                                               virtual):
    if COMM.size % pp:
        pytest.skip(f"pp={pp} needs a multiple of {pp} ranks")
    trainer, (_, ref) = _fit(_pipeline(mpi_dataset, shared_tmp, pp, schedule, virtual))
    stage = trainer.model
    if stage.has_head:  # the untied head is the last stage's own parameter
        assert "lm_head.weight" in dict(stage.named_parameters())
        assert stage.head_copy is None


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule,virtual", SCHEDULES)
def test_llama_zero1_along_dp_with_pipeline(mpi_dataset, shared_tmp, schedule, virtual):
    trainer, _ = _fit(_pipeline(mpi_dataset, shared_tmp, 2, schedule, virtual,
                                **{"parallel.zero": 1, "parallel.micro_batches": 2}))
    assert (trainer.grid.dp, trainer.grid.pp) == (COMM.size // 2, 2)


def test_llama_tied_head_in_a_pipeline_with_chunked_loss(mpi_dataset, shared_tmp):
    """A tied Llama (as the small Llama 3.2 models): the head's copy of the embedding
    crosses the pipeline as GPT-2's does."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    trainer, (_, ref) = _fit(_pipeline(mpi_dataset, shared_tmp, 2, **{
        "model.tie_embeddings": True, "model.loss_chunk": 16}))
    if trainer.model.has_head:
        torch.testing.assert_close(trainer.model.head_copy.detach(), ref.params["wte.weight"],
                                   atol=1e-5, rtol=0)


@pytest.mark.parametrize("stage,pp", [(0, 1), (3, 1), (1, 2)])
def test_llama_bf16_matches_the_bf16_single_process_run(mpi_dataset, shared_tmp, stage, pp):
    if COMM.size % pp:
        pytest.skip(f"pp={pp} needs a multiple of {pp} ranks")
    extra = {"train.dtype": "bf16", "parallel.zero": stage, "parallel.micro_batches": 2}
    cfg = (_pipeline(mpi_dataset, shared_tmp, pp, **extra) if pp > 1
           else _config(mpi_dataset, shared_tmp, **extra))
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_bf16_against_reference(trainer, cfg)


def test_llama_checkpoint_moves_between_pipeline_and_zero3(mpi_dataset, shared_tmp):
    """Saved at pp=2, resumed with every rank data-parallel under ZeRO-3: the losses go
    on as the uninterrupted run's."""
    if COMM.size % 2:
        pytest.skip("needs an even number of ranks")
    out = Path(shared_tmp)
    save = {"train.max_iters": 10, "train.ckpt_interval": 5, "train.save_checkpoint": True,
            "parallel.micro_batches": 2}
    full = Trainer(_pipeline(mpi_dataset, out / "pp", 2, **save), cpu_world(COMM),
                   verbose=False).fit()
    flat = Trainer(_config(mpi_dataset, out / "flat", **{
        **save, "model.n_layer": 8, "parallel.zero": 3,
        "parallel.micro_batches": 2 if COMM.size == 2 else 1,
        "train.resume": str(out / "pp" / "checkpoints" / "step_000005")}),
        cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(flat.losses, full.losses[5:], atol=1e-5, rtol=0)
