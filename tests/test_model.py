"""The GPT model alone (no MPI)."""

import math

import pytest
import torch

from hpctrain.model.gpt import GPT, GPTConfig, compile_model
from hpctrain.model.shape import SHAPE_KEYS


def small(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, **kw))


def test_shapes_loss_and_tied_embeddings():
    m = small()
    x, y = torch.randint(0, 50, (2, 3, 16))
    loss = m(x, y)
    assert loss.shape == () and abs(loss.item() - math.log(50)) < 0.3  # near uniform at init
    assert m(x).shape == (3, 1, 50)
    assert m.lm_head.weight is m.wte.weight
    names = [n for n, _ in m.named_parameters()]
    assert "lm_head.weight" not in names  # tied: counted and reduced once


def test_residual_projections_use_scaled_init():
    m = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=8, n_head=2, n_embd=256))
    std = m.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 1e-3
    assert abs(m.h[0].mlp.c_fc.weight.std().item() - 0.02) < 1e-3


def test_param_count_and_flops_follow_the_formulas():
    m = small(bias=True)
    c = m.cfg
    per_block = 12 * c.n_embd ** 2 + 13 * c.n_embd  # weights + biases + 2 LayerNorms
    expected = c.vocab_size * c.n_embd + c.n_layer * per_block + 2 * c.n_embd
    assert m.num_params() == expected
    assert m.flops_per_token() == 6 * expected + 12 * c.n_layer * c.n_embd * c.block_size


def test_causality_future_tokens_do_not_change_past_logits():
    m = small()
    m.eval()
    x = torch.randint(0, 50, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 50
    hx = m.logits(m.h[1](m.h[0](m.embed(x))))
    hy = m.logits(m.h[1](m.h[0](m.embed(y))))
    torch.testing.assert_close(hx[:, :10], hy[:, :10])
    assert not torch.allclose(hx[:, 10:], hy[:, 10:])


def test_generate_extends_and_respects_block_size():
    m = small()
    out = m.generate(torch.zeros(2, 3, dtype=torch.long), 20, top_k=5,
                     generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 23) and int(out.max()) < 50


def test_dropout_only_in_training():
    m = small(dropout=0.5)
    x = torch.randint(0, 50, (2, 16))
    m.eval()
    assert torch.equal(m(x, x), m(x, x))
    m.train()
    assert not torch.equal(m(x, x), m(x, x))


SHAPES = [dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32),
          dict(vocab_size=97, block_size=8, n_layer=3, n_head=4, n_embd=64),
          dict(vocab_size=11, block_size=5, n_layer=1, n_head=1, n_embd=8)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_config_counts_the_parameters_of_the_model_it_builds(shape, bias):
    cfg = GPTConfig(**shape, bias=bias)
    with torch.device("meta"):
        m = GPT(cfg)
    every = {n: p.numel() for n, p in m.named_parameters()}  # the tied weight once
    assert cfg.num_params(non_embedding=False) == sum(every.values())
    assert cfg.num_params() == sum(every.values()) - every["wpe.weight"]
    assert cfg.block_params() == sum(v for n, v in every.items() if n.startswith("h.0."))
    assert m.num_params() == cfg.num_params() and m.flops_per_token() == cfg.flops_per_token()


@pytest.mark.parametrize("shape", SHAPES)
def test_flops_per_token_is_6n_plus_attention(shape):
    cfg = GPTConfig(**shape)
    L, C, T = cfg.n_layer, cfg.n_embd, cfg.block_size
    assert cfg.flops_per_token() == 6 * cfg.num_params() + 12 * L * C * T


def test_shape_record_round_trips_and_leaves_out_dropout():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32,
                    dropout=0.5, bias=True)
    record = cfg.shape()
    assert "dropout" not in record and set(record) == set(SHAPE_KEYS)
    back = GPTConfig.from_shape({**record, "dropout": 0.5, "other": 1})  # a config section
    assert back == GPTConfig(**record)  # the shape only: dropout is not part of it
    assert back.bias is True and back.dropout == 0.0
    with pytest.raises(KeyError):
        GPTConfig.from_shape({k: v for k, v in record.items() if k != "bias"})


# ------------------------------------------------------------ a padded vocabulary

def test_padding_changes_no_value_the_model_computes():
    """Same seed, with and without padding: the same initial values, loss and gradients;
    the padded rows are zero, get a zero gradient and appear in no logit."""
    plain, padded = small(), small(vocab_multiple=64)
    assert padded.wte.weight.shape == (64, 32) and padded.lm_head.weight is padded.wte.weight
    assert padded.cfg.padded_vocab_size == 64 and padded.cfg.vocab_size == 50
    x, y = torch.randint(0, 50, (2, 3, 16), generator=torch.Generator().manual_seed(1))
    plain(x, y).backward()
    padded(x, y).backward()
    torch.testing.assert_close(padded(x, y), plain(x, y), atol=0, rtol=0)
    for (name, p), q in zip(plain.named_parameters(), padded.parameters()):
        q, g = (q[:50], q.grad[:50]) if name == "wte.weight" else (q, q.grad)
        torch.testing.assert_close(q, p, atol=0, rtol=0)
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    assert not padded.wte.weight[50:].any() and not padded.wte.weight.grad[50:].any()
    assert padded(x).shape == (3, 1, 50)


def test_padded_ids_are_never_sampled():
    """Padded rows that would win every softmax if their logits were kept."""
    m = small(vocab_multiple=64)
    with torch.no_grad():
        m.wte.weight[50:] = 10 * m.ln_f.weight.sign()  # logit 10 x |h| per padded id
    out = m.generate(torch.zeros(4, 1, dtype=torch.long), 30,
                     generator=torch.Generator().manual_seed(0))
    assert int(out.max()) < 50


def test_padding_counts_in_parameters_not_in_flops():
    plain, padded = (GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12,
                               n_embd=768, vocab_multiple=m) for m in (1, 64))
    assert padded.padded_vocab_size == 50304 and plain.padded_vocab_size == 50257
    assert padded.num_params() - plain.num_params() == 47 * 768  # rows that take memory
    assert padded.flops_per_token() == plain.flops_per_token()  # but do no useful work
    assert GPTConfig(vocab_size=128, vocab_multiple=64).padded_vocab_size == 128


def test_shape_records_padding_and_old_records_mean_none():
    cfg = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32,
                    vocab_multiple=64, recompute="block")
    record = cfg.shape()
    assert record["vocab_multiple"] == 64 and "recompute" not in record
    assert GPTConfig.from_shape(record).padded_vocab_size == 64
    older = {k: v for k, v in record.items() if k != "vocab_multiple"}  # before padding
    assert GPTConfig.from_shape(older).vocab_multiple == 1


# ------------------------------------------------- recomputation and compilation

def _loss_and_grads(m, x, y):
    loss = m(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in m.named_parameters()}


def _saved_bytes(m, x, y) -> int:
    """Bytes of the tensors autograd keeps for backward (parameters included)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, y)
    return total


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_recompute_gives_the_same_loss_and_gradients_with_less_saved(dropout):
    """Dropout too: the recomputed forward must draw the same masks."""
    x, y = torch.randint(0, 50, (2, 4, 16), generator=torch.Generator().manual_seed(2))
    plain, recomputed = small(dropout=dropout), small(dropout=dropout, recompute="block")
    torch.manual_seed(5)
    want_loss, want = _loss_and_grads(plain, x, y)
    torch.manual_seed(5)
    loss, got = _loss_and_grads(recomputed, x, y)
    torch.testing.assert_close(loss, want_loss, atol=0, rtol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=name)
    assert _saved_bytes(recomputed, x, y) < 0.5 * _saved_bytes(plain, x, y)
    recomputed.eval(), plain.eval()
    with torch.no_grad():  # evaluation keeps nothing either way: no recomputation
        torch.testing.assert_close(recomputed(x), plain(x))


def test_compile_model_compiles_each_block_and_the_head_of_a_model_or_a_stage():
    m = small()
    assert compile_model(m) == 2
    assert all(b.compiled_body is not None for b in m.h)
    assert m.compiled_loss is not None
    assert compile_model(torch.nn.ModuleDict({"1": m.h[1]})) == 1  # a stage's blocks


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "block"])
def test_compiled_blocks_give_the_same_loss_and_gradients(recompute, arch):
    """torch.compile on this CPU (inductor generates and builds C++): the compiled
    blocks and head with its loss compute what the eager ones do, to fp32 round-off
    (fused kernels reorder sums), with a padded vocabulary and ignored targets. Llama's
    rotary tables: a recomputed block must trace the graph its first forward did."""
    x, y = torch.randint(0, 50, (2, 4, 16), generator=torch.Generator().manual_seed(3))
    y[0, :5] = -1  # tokens that do not count
    want_loss, want = _loss_and_grads(small(vocab_multiple=64, arch=arch), x, y)
    m = small(recompute=recompute, vocab_multiple=64, arch=arch)
    compile_model(m)
    for _ in range(2):  # the second call runs the compiled code without compiling
        m.zero_grad()
        loss, got = _loss_and_grads(m, x, y)
        torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=0)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, atol=1e-5, rtol=1e-4, msg=name)
