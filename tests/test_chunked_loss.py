"""The chunked head and cross-entropy (``--model.loss_chunk``) against the plain one: the
same loss and gradients for both architectures, in a pipeline's last stage and in the
trainer, and none of the tokens x vocabulary tensors kept for backward."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

from hpctrain.model.chunked_loss import chunked_cross_entropy
from hpctrain.model import gpt as gpt_module
from hpctrain.model import shape as shape_module
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.model.shape import AUTO_LOGITS_BYTES, WHOLE_HEAD, head_chunk
from hpctrain.parallel.pipeline.stage import PipelineStage
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, fit_against_reference, tiny_config
from tests.reference import plain_model_config

V, VP = 97, 100  # vocab_multiple=50 pads 3 rows, whose logits must stay out; no other
# dimension of these models is 97 or 100, so a saved (tokens x V) tensor is easy to spot
ROWS, T = 3, 16  # 48 tokens: chunks of 7 leave a ragged last one, 16 divide, 64 is one

ARCHS = [  # (arch, tied head)
    ("gpt", True),
    ("llama", True),
    ("llama", False),
]


def _cfg(arch: str, tied: bool, **kw) -> GPTConfig:
    heads = {"n_head": 4, "n_kv_head": 2} if arch == "llama" else {"n_head": 4}
    return GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_embd=32, arch=arch,
                     tie_embeddings=tied, vocab_multiple=50, **heads, **kw)


def _pair(arch: str, tied: bool, chunk: int, dtype=torch.float32) -> tuple[GPT, GPT]:
    """The same weights twice: the plain model and the chunked one."""
    torch.manual_seed(0)
    plain = GPT(_cfg(arch, tied, loss_chunk=WHOLE_HEAD)).to(dtype)
    chunked = GPT(_cfg(arch, tied, loss_chunk=chunk)).to(dtype)
    chunked.load_state_dict(plain.state_dict())
    return plain, chunked


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (ROWS, T), generator=gen)
    y = torch.randint(0, V, (ROWS, T), generator=gen)
    y[0, :12] = -1  # ignored targets; with chunks of 7 a whole chunk counts for nothing
    y[2, 5] = -1
    return x, y


def _loss_and_grads(model, x, y) -> tuple[torch.Tensor, dict]:
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """|got - want| / |want| in the L2 norm, computed in fp64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def _assert_same(got_loss, got, want_loss, want, rtol: float) -> None:
    assert relative_error(got_loss, want_loss) <= rtol, (float(got_loss), float(want_loss))
    assert got.keys() == want.keys()
    for name, g in want.items():
        err = relative_error(got[name], g)
        assert err <= rtol, f"{name}: gradient differs by {err:.3g} relative (allowed {rtol:g})"


@pytest.mark.parametrize("chunk", [7, 16, 64])
@pytest.mark.parametrize("arch,tied", ARCHS)
def test_chunked_loss_and_gradients_equal_the_plain_ones_in_fp32(arch, tied, chunk):
    plain, chunked = _pair(arch, tied, chunk)
    x, y = _batch()
    want_loss, want = _loss_and_grads(plain, x, y)
    got_loss, got = _loss_and_grads(chunked, x, y)
    _assert_same(got_loss, got, want_loss, want, rtol=1e-6)
    head = "wte.weight" if tied else "lm_head.weight"
    assert not got[head][V:].any()  # the padded rows: never a logit, so no gradient


@pytest.mark.parametrize("arch,tied", ARCHS)
def test_chunked_loss_is_close_in_bf16(arch, tied):
    """bf16 matmuls round at 8 bits either way; the chunked head sums its weight gradient
    over the chunks in fp32, the plain one in a single matmul."""
    plain, chunked = _pair(arch, tied, 7, torch.bfloat16)
    x, y = _batch()
    want_loss, want = _loss_and_grads(plain, x, y)
    got_loss, got = _loss_and_grads(chunked, x, y)
    assert got_loss.dtype == torch.float32  # the softmax in fp32, as the plain path
    _assert_same(got_loss, got, want_loss, want, rtol=2e-2)
    assert all(g.dtype == torch.bfloat16 for g in got.values())


def test_the_function_alone_matches_cross_entropy_with_ignored_tokens():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(50, 8, generator=gen, requires_grad=True)
    w = torch.randn(13, 8, generator=gen, requires_grad=True)  # 10 real rows, 3 padding
    t = torch.randint(0, 10, (50,), generator=gen)
    t[::4] = -1
    want = torch.nn.functional.cross_entropy(h @ w[:10].t(), t, ignore_index=-1)
    gh, gw = torch.autograd.grad(want, (h, w))
    got = chunked_cross_entropy(h, w, t, 10, 6)
    ch, cw = torch.autograd.grad(got, (h, w))
    assert relative_error(got, want) <= 1e-6
    assert relative_error(ch, gh) <= 1e-6 and relative_error(cw, gw) <= 1e-6
    assert not cw[10:].any()


@pytest.mark.parametrize("arch,tied", [("gpt", True), ("llama", False)])
def test_a_last_pipeline_stage_computes_the_chunked_loss(arch, tied):
    """Two stages chained in one process (as tests/test_pipeline.py): the last one runs
    ``head_loss`` with its own head (untied) or its copy of the embedding (tied)."""
    plain, _ = _pair(arch, tied, 7)
    x, y = _batch()
    want_loss, want = _loss_and_grads(plain, x, y)
    torch.manual_seed(0)
    gpt = GPT(_cfg(arch, tied, loss_chunk=7))
    gpt.load_state_dict(plain.state_dict())
    first, last = PipelineStage(gpt, 0, 2), PipelineStage(gpt, 1, 2)
    h = first.chunk_forward(0, x)
    h_in = h.detach().requires_grad_(True)
    loss = last.chunk_forward(0, h_in, y)
    loss.backward()
    h.backward(h_in.grad)
    got = {n: p.grad for st in (first, last) for n, p in st.named_parameters()}
    if tied:  # the head's share of the tied gradient lives on the last stage's copy
        got["wte.weight"] = got["wte.weight"] + last.head_weight.grad
    _assert_same(loss.detach(), got, want_loss, want, rtol=1e-6)


def _saved(model, x, y) -> list[tuple[tuple, int]]:
    """Shape and bytes of every tensor autograd keeps for backward in one forward, each
    once (log_softmax and nll_loss keep the same log-probabilities)."""
    saved = {}

    def pack(t):
        saved[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return [(shape, n) for (_, shape), n in saved.items()]


@pytest.mark.parametrize("arch,tied", [("gpt", True), ("llama", False)])
def test_the_chunked_head_keeps_no_tokens_by_vocabulary_tensor(arch, tied):
    """The plain head keeps fp32 log-probabilities of every token (tokens x V) for
    backward; the chunked one keeps one log-sum-exp per token instead (its backward
    makes one chunk of logits at a time, ``perf/bench_long_context.py`` measures the
    peak)."""
    plain, chunked = _pair(arch, tied, 7)
    x, y = _batch()
    plain_saved, chunked_saved = _saved(plain, x, y), _saved(chunked, x, y)

    def by_vocab(saved):  # the head's weight (VP, C) is a parameter, not an activation
        return [s for s, _ in saved if {V, VP} & set(s) and sorted(s) != [32, VP]]

    assert by_vocab(plain_saved) == [(ROWS * T, V)]  # log-probabilities, fp32
    assert by_vocab(chunked_saved) == []
    logprobs = ROWS * T * V * 4
    assert sum(b for _, b in plain_saved) - sum(b for _, b in chunked_saved) > 0.9 * logprobs


def _train(cfg):
    return Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_trainer_with_loss_chunk_trains_as_without(dataset_path, tmp_path, arch):
    """Ten steps of the tiny config (2 micro-batches of 4 x 16 tokens) with chunks of 24
    tokens: the plain loop's losses, first gradients and final parameters."""
    cfg = tiny_config(dataset_path, tmp_path, **{"model.loss_chunk": 24, "model.arch": arch,
                                                 "parallel.micro_batches": 2})
    trainer = _train(cfg)
    assert trainer.gpt_cfg.loss_chunk == 24
    plain = plain_model_config(cfg)
    assert plain.model.loss_chunk == WHOLE_HEAD
    fit_against_reference(trainer, plain)


def test_the_automatic_rule_chunks_above_the_bound_and_not_at_it():
    """``loss_chunk=0``: all at once while tokens x columns x 4 bytes fit the bound
    (equal included), else chunks of as many tokens as fit; an explicit N or -1 wins."""
    bound = AUTO_LOGITS_BYTES
    assert bound == 256 * 2**20
    per_token = 4 * 50257  # GPT-2's vocabulary
    fits = bound // per_token  # 1335 tokens
    assert head_chunk(0, fits, 50257) == 0
    assert head_chunk(0, fits + 1, 50257) == fits
    assert head_chunk(0, 8 * 2048, 50257) == fits  # GPT-2 medium, 8 rows of 2048
    assert head_chunk(0, 10, 4, bound=40 * 4) == 0  # exactly at the bound: whole
    assert head_chunk(0, 11, 4, bound=40 * 4) == 10
    assert head_chunk(0, 11, 1000, bound=100) == 1  # not one token fits: one at a time
    assert head_chunk(0, 1 << 20, 128256 // 4) == bound // (4 * 32064)  # a tp=4 slice
    assert head_chunk(24, 10, 4) == 24 and head_chunk(WHOLE_HEAD, 1 << 30, 50257) == 0
    assert GPTConfig(vocab_size=50257).head_chunk(fits + 1) == fits


def _spy_chunks(monkeypatch) -> list[int]:
    """The chunk each call of the GPT's chunked head gets (none: the plain head ran)."""
    seen, real = [], gpt_module.chunked_cross_entropy

    def spy(h, weight, targets, vocab, chunk):
        seen.append(chunk)
        return real(h, weight, targets, vocab, chunk)

    monkeypatch.setattr(gpt_module, "chunked_cross_entropy", spy)
    return seen


@pytest.mark.parametrize("arch,tied", [("gpt", True), ("llama", False)])
def test_the_automatic_head_chunks_only_above_the_bound_with_the_same_results(
        monkeypatch, arch, tied):
    """The default model (loss_chunk 0) under a bound of 10 tokens' logits: 48 tokens go
    in chunks of 10 with the plain head's loss and gradients; under a bound that holds
    all 48 tokens' logits, the plain head runs."""
    torch.manual_seed(0)
    plain = GPT(_cfg(arch, tied, loss_chunk=WHOLE_HEAD))
    auto = GPT(_cfg(arch, tied))
    auto.load_state_dict(plain.state_dict())
    assert auto.cfg.loss_chunk == 0
    x, y = _batch()
    seen = _spy_chunks(monkeypatch)
    want_loss, want = _loss_and_grads(plain, x, y)
    assert seen == []
    monkeypatch.setattr(shape_module, "AUTO_LOGITS_BYTES", 10 * V * 4)
    got_loss, got = _loss_and_grads(auto, x, y)
    assert seen == [10]
    _assert_same(got_loss, got, want_loss, want, rtol=1e-6)
    monkeypatch.setattr(shape_module, "AUTO_LOGITS_BYTES", ROWS * T * V * 4)
    auto(x, y)
    assert seen == [10]  # 48 tokens' logits fit: no chunked call
