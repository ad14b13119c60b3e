"""Context parallelism (``--parallel.cp``) in training, over real MPI ranks, against the
single-process run: the first step's reduced gradients and norm, every loss, the final
parameters (``tests/helpers.py``). Each sequence is cut into 2 cp chunks, two per rank;
attention runs as ring attention (``parallel/context/``), the positions are global, the
loader reads each rank's chunks, and gradients are reduced over dp x cp.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint.sharded import read_manifest
from hpctrain.parallel.context.apply import RingContext
from hpctrain.train.trainer import Trainer
from tests.helpers import (cpu_world, fit_against_reference, fit_bf16_against_reference,
                           tiny_config)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
SMALL_BUCKETS = {"parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005}
LLAMA_GQA = {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 2,
             "model.ffn_hidden": 48, "model.tie_embeddings": False,
             "model.rope_theta": 500.0, "model.vocab_multiple": 8}
ARCHS = {"gpt": {}, "llama": LLAMA_GQA}
# Ring attention sums each query's keys block by block (the log-sum-exp merge) where
# the reference's attention sums them in one pass: the first step's reduced gradients
# differ in the last bits, as data parallelism's do (GRAD_RTOL's 1e-6 holds at cp = 2
# and 4, measured; the equivalence tests keep that bound).


def _config(data, out, cp, **overrides):
    return tiny_config(data, out, **{"parallel.cp": cp, **SMALL_BUCKETS, **overrides})


def _trainer(cfg, comm=COMM):
    trainer = Trainer(cfg, cpu_world(comm), verbose=False)
    attns = [m for m in trainer.model.modules() if hasattr(m, "context")]
    assert attns and all(isinstance(m.context, RingContext) for m in attns), \
        "the blocks do not run ring attention"
    return trainer


def _fit(cfg, comm=COMM):
    trainer = _trainer(cfg, comm)
    grid = trainer.grid
    assert (grid.cp, grid.dp_world.size) == (cfg.parallel.cp, grid.dp * grid.cp)
    return fit_against_reference(trainer, cfg, grid.dp_world.comm)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_context_parallel_over_every_rank_matches_single_process(mpi_dataset, shared_tmp,
                                                                 arch):
    """cp = the world size (2 or 4): GPT-2's learned and Llama's rotary positions, the
    latter with 4 query heads on 2 key/value heads; two micro-batches."""
    _fit(_config(mpi_dataset, shared_tmp, COMM.size, **ARCHS[arch],
                 **{"parallel.micro_batches": 2}))


@pytest.mark.parametrize("zero", [0, 3])
def test_context_parallel_with_zero_matches_single_process(mpi_dataset, shared_tmp, zero):
    """cp = 2 with ZeRO sharding over dp x cp (dp = 2 at 4 ranks); level 3 with the
    chunked loss and recomputation (Llama)."""
    extra = {"model.loss_chunk": 6, "model.recompute": "block", **LLAMA_GQA} if zero == 3 else {}
    _fit(_config(mpi_dataset, shared_tmp, 2, **{"parallel.zero": zero, **extra}))


@pytest.mark.mpi(min_size=4)
def test_context_parallel_with_tensor_parallel_and_sequence_parallel(mpi_dataset, shared_tmp):
    """cp = 2 x tp = 2 with sequence parallelism inside each context-parallel rank."""
    _fit(_config(mpi_dataset, shared_tmp, 2, **LLAMA_GQA, **{
        "parallel.tp": 2, "parallel.sequence_parallel": True}))


def test_context_parallel_in_bf16(mpi_dataset, shared_tmp):
    cfg = _config(mpi_dataset, shared_tmp, 2, **{"train.dtype": "bf16"})
    fit_bf16_against_reference(_trainer(cfg), cfg)


def test_a_checkpoint_saved_at_cp2_resumes_at_cp1(mpi_dataset, shared_tmp):
    """cp does not change the parameters' layout: a checkpoint of a cp = 2 run resumes
    as plain data parallelism over every rank (dp = 2 at 2 ranks) and on one rank, and
    the losses continue the uninterrupted run's."""
    ckpt = {"train.ckpt_interval": 5, "train.save_checkpoint": True}
    full = _trainer(_config(mpi_dataset, f"{shared_tmp}/cp", 2, **ckpt)).fit()
    step5 = f"{shared_tmp}/cp/checkpoints/step_000005"
    assert read_manifest(step5).world_size == COMM.size
    resumed = Trainer(_config(mpi_dataset, f"{shared_tmp}/dp", 1, **{"train.resume": step5}),
                      cpu_world(COMM), verbose=False).fit()
    np.testing.assert_allclose(resumed.losses, full.losses[5:], atol=1e-5, rtol=0)
    sub = COMM.Split(color=int(COMM.rank == 0), key=COMM.rank)
    if COMM.rank == 0:
        alone = Trainer(_config(mpi_dataset, f"{shared_tmp}/one", 1,
                                **{"train.resume": step5}), cpu_world(sub), verbose=False).fit()
        np.testing.assert_allclose(alone.losses, full.losses[5:], atol=1e-5, rtol=0)
    sub.Free()
    COMM.Barrier()


def test_each_rank_reads_only_its_two_chunks(mpi_dataset, shared_tmp):
    """The loader's rows on each rank of a cp group are its chunks (i, 2 cp - 1 - i) of
    the rows every rank of the replica would read whole, inputs and targets alike."""
    cp = COMM.size
    # No prefetch: its thread's next collective read would meet this test's own on the
    # same file handle (Open MPI then reads short).
    trainer = Trainer(_config(mpi_dataset, shared_tmp, cp, **{"data.prefetch": False}),
                      cpu_world(COMM), verbose=False)
    try:
        x, y = trainer.batches.train(0)
        whole = trainer.batches.sampler.local_starts(0, 0, 1)
        tokens = torch.from_numpy(np.asarray(trainer.batches.data.reader.read(
            "train", whole, 17))).long()
        T, size, r = 16, 16 // (2 * cp), COMM.rank
        for got, want in ((x, tokens[:, :T]), (y, tokens[:, 1:])):
            chunks = [want[:, c * size:(c + 1) * size] for c in (r, 2 * cp - 1 - r)]
            assert torch.equal(got.long().cpu(), torch.cat(chunks, 1))
    finally:
        trainer.close()


@pytest.mark.mpi(min_size=4)
def test_context_parallel_along_a_pipeline(mpi_dataset, shared_tmp):
    """cp = 2 x pp = 2: the stage boundaries carry each rank's part of the sequence."""
    _fit(_config(mpi_dataset, shared_tmp, 2, **LLAMA_GQA, **{
        "parallel.pp": 2, "parallel.micro_batches": 2, "model.n_layer": 4}))


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", ["dp2-tp2", "dp2-pp2"])
def test_eight_rank_combinations(mpi_dataset, shared_tmp, layout):
    """At 8 ranks (``make test-slow`` launches them: tests/test_context_parallel_eight.py):
    cp = 2 x tp = 2 (sequence parallel) x dp = 2 with ZeRO-1, and cp = 2 x pp = 2 x dp = 2
    with ZeRO-1 (Llama, GQA)."""
    inner = ({"parallel.tp": 2, "parallel.sequence_parallel": True} if layout == "dp2-tp2"
             else {"parallel.pp": 2, "parallel.micro_batches": 2, "model.n_layer": 4})
    _fit(_config(mpi_dataset, shared_tmp, 2, **LLAMA_GQA, **inner, **{"parallel.zero": 1}))
