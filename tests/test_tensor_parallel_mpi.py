"""Tensor parallelism (``--parallel.tp``) and sequence parallelism over real MPI ranks,
against the single-process result: the same checks as every other layout (first-step
reduced gradients, slices joined over the group, and norm; every loss; the final
parameters; ``tests/helpers.py``), alone and with data parallelism, ZeRO and pipelines.

Run under ``mpiexec -n 2`` and ``-n 4`` with pytest-mpi (``make test`` does both).
"""

import pytest
from mpi4py import MPI

from hpctrain.train.trainer import Trainer
from tests.helpers import (SGD, cpu_world, fit_against_reference, fit_bf16_against_reference,
                           tiny_config)

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD
SMALL = {"model.n_head": 4, "model.vocab_multiple": 8, "parallel.bucket_mb": 0.02,
         "parallel.first_bucket_mb": 0.005}
"""Four heads and a vocabulary padded to a multiple of 8: splittable over 2 and 4 ranks."""
LLAMA = {"model.arch": "llama", "model.n_head": 8, "model.n_kv_head": 4,
         "model.ffn_hidden": 48, "model.tie_embeddings": False, "model.rope_theta": 500.0}
"""Grouped-query attention (8 query heads on 4 key/value heads) and an untied head."""


def _config(data, out, **overrides):
    return tiny_config(data, out, **{**SMALL, **overrides})


def _fit(cfg, **kwargs):
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    grid = trainer.grid
    assert grid.tp == cfg.parallel.tp and grid.tp_comm.size == cfg.parallel.tp
    fit_against_reference(trainer, cfg, grid.dp_world.comm, **kwargs)
    return trainer


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_tensor_parallel_over_every_rank_matches_single_process(mpi_dataset, shared_tmp,
                                                                arch, sequence_parallel):
    """tp = the world (2 or 4): every layer split, GPT-2 tied with biases, Llama with
    grouped-query attention and its own head."""
    extra = LLAMA if arch == "llama" else {"model.bias": True}
    trainer = _fit(_config(mpi_dataset, shared_tmp, **extra, **{
        "parallel.tp": COMM.size, "parallel.sequence_parallel": sequence_parallel}))
    attn = trainer.model.h[0].attn
    assert attn.n_head == trainer.gpt_cfg.n_head // COMM.size
    assert attn.c_attn.weight.shape[0] == sum(attn.widths)


@pytest.mark.parametrize("sequence_parallel,compile_", [
    (False, False), (True, False), pytest.param(True, True, marks=pytest.mark.slow)])
def test_tensor_parallel_with_chunked_loss_and_recompute(mpi_dataset, shared_tmp,
                                                         sequence_parallel, compile_):
    """The vocabulary-parallel loss a chunk at a time, the blocks recomputed in backward
    (their collectives run again, in the same order on every rank), two micro-batches.
    With compile, the group's collectives stay outside the compiled block bodies."""
    _fit(_config(mpi_dataset, shared_tmp, **LLAMA, **{"train.compile": compile_,
        "parallel.tp": 2 if COMM.size == 2 else 4, "model.loss_chunk": 24,
        "model.recompute": "block", "parallel.micro_batches": 2,
        "parallel.sequence_parallel": sequence_parallel}))


def test_tensor_parallel_automatic_loss_chunk_matches_single_process(mpi_dataset, shared_tmp,
                                                                    monkeypatch):
    """``loss_chunk`` 0 (automatic) under a 4 KiB bound: each rank's slice of the
    logits goes in chunks of as many tokens as fit the bound, and trains as the plain
    single-process head."""
    from hpctrain.model import shape
    from hpctrain.parallel.tensor import apply

    seen, real = [], apply.vocab_parallel_cross_entropy

    def spy(h, weight, targets, group, start, real_rows, chunk):
        seen.append((chunk, targets.numel(), weight.shape[0]))
        return real(h, weight, targets, group, start, real_rows, chunk)

    monkeypatch.setattr(apply, "vocab_parallel_cross_entropy", spy)
    monkeypatch.setattr(shape, "AUTO_LOGITS_BYTES", 4096)
    _fit(_config(mpi_dataset, shared_tmp, **{"parallel.tp": 2}))
    assert seen and all(chunk == 4096 // (4 * rows) and 0 < chunk < tokens
                        for chunk, tokens, rows in seen), seen[:3]


def test_tensor_parallel_with_plain_sgd(mpi_dataset, shared_tmp):
    """SGD without clipping: a gradient summed twice over the group, or never, shows in
    the loss at the second step."""
    _fit(_config(mpi_dataset, shared_tmp, **SGD, **{"parallel.tp": 2,
                                                    "parallel.sequence_parallel": True}))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_tensor_parallel_with_data_parallel_and_zero(mpi_dataset, shared_tmp, stage):
    """tp=2 x dp=2: the reductions run over the ranks holding the same slices, a ZeRO
    shard is a shard of a slice, and the norm counts each whole parameter once."""
    trainer = _fit(_config(mpi_dataset, shared_tmp, **{
        "parallel.tp": 2, "parallel.zero": stage, "parallel.micro_batches": 2,
        "parallel.sequence_parallel": stage == 3}))
    assert (trainer.grid.dp, trainer.grid.tp) == (COMM.size // 2, 2)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("schedule,virtual", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                              ("zbv", 1)])
def test_tensor_parallel_with_a_pipeline(mpi_dataset, shared_tmp, schedule, virtual):
    """tp=2 x pp=2: each stage's layers split over its pair of ranks; the stages pass
    this rank's tokens of the residual stream (sequence parallelism), and the tied head's
    copy of the embedding slice crosses the pipeline. zb-h1: the group's collectives of
    the input gradient run in B, the norms' gradient sums in W (GPipe's fused backward
    is 1F1B's, in another order). zbv (4 micro-batches fill its V at pp=2): the head
    sits on stage 0 beside the embedding slice it uses (no copy crosses), and the last
    stage hands its sequence-parallel slice from one chunk to the other locally."""
    trainer = _fit(_config(mpi_dataset, shared_tmp, **{
        "model.n_layer": 4, "parallel.tp": 2, "parallel.pp": 2,
        "parallel.micro_batches": 4, "parallel.schedule": schedule,
        "parallel.virtual_stages": virtual, "parallel.sequence_parallel": True,
        "train.max_iters": 6}))
    assert (trainer.grid.pp, trainer.grid.tp) == (2, 2)
    if schedule == "zbv":
        assert trainer.model.has_head == (trainer.grid.stage == 0)
        assert trainer.model.head_copy is None


def test_tensor_parallel_in_bf16(mpi_dataset, shared_tmp):
    """bf16 compute with fp32 master weights; the group sums activations in fp32 over
    MPI, as the single-process model's matmuls accumulate. Plain SGD: Adam's first
    updates are near lr x sign(gradient), so a rare token's embedding row, whose
    gradient is near zero, moves by a whole step on either side of a bf16 rounding."""
    cfg = _config(mpi_dataset, shared_tmp, **LLAMA, **SGD, **{
        "parallel.tp": 2, "train.dtype": "bf16", "parallel.sequence_parallel": True})
    trainer = Trainer(cfg, cpu_world(COMM), verbose=False)
    fit_bf16_against_reference(trainer, cfg)


def test_tensor_parallel_refuses_what_it_cannot_split(mpi_dataset, shared_tmp):
    """Three heads over two ranks, and dropout: one message naming the options."""
    from hpctrain.parallel.tensor.layout import TensorParallelError

    for overrides, words in (({"model.n_head": 3, "model.n_embd": 30},
                              "--model.n_head=3 is not a multiple of --parallel.tp=2"),
                             ({"model.dropout": 0.1}, "needs --model.dropout=0")):
        cfg = _config(mpi_dataset, shared_tmp, **{"parallel.tp": 2, **overrides})
        with pytest.raises(TensorParallelError, match=words):
            Trainer(cfg, cpu_world(COMM), verbose=False)
