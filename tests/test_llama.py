"""The Llama family's parts in one process: counts, rotary embeddings, grouped-query
attention, the untied head, and options that must not change what it computes.
(Its parallel runs: ``test_llama_mpi.py``; its Hugging Face logits: the hf leg.)"""

import math

import pytest
import torch

from hpctrain.model.gpt import GPT
from hpctrain.model.llama.layers import RMSNorm
from hpctrain.model.llama.rope import Rotary, inverse_frequencies
from hpctrain.model.shape import GPTConfig, default_ffn_hidden


def _llama(**kw) -> GPTConfig:
    base = dict(vocab_size=50, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                arch="llama", ffn_hidden=48, tie_embeddings=False, vocab_multiple=16)
    return GPTConfig(**{**base, **kw})


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True}, {"n_kv_head": 4},
                                {"n_kv_head": 1, "bias": True}, {"ffn_hidden": 0}])
def test_parameter_count_is_the_shapes(kw):
    cfg = _llama(**kw)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params(non_embedding=False)
    assert "wpe.weight" not in dict(model.named_parameters())  # positions are rotations
    assert ("lm_head.weight" in dict(model.named_parameters())) == (not cfg.tie_embeddings)


def test_llama_hidden_size_rule():
    """8/3 C rounded up to 256 (Llama 2 7B: 4096 -> 11008)."""
    assert default_ffn_hidden("llama", 4096) == 11008
    assert default_ffn_hidden("gpt", 768) == 3072


def test_rotary_scores_depend_on_distance_only():
    """<R(m) q, R(n) k> = <R(m+s) q, R(n+s) k>: the point of rotary embeddings."""
    torch.manual_seed(0)
    rot = Rotary(16, 10000.0)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    x = torch.stack([q, k] * 10).float()[None, None]  # (1, 1, 20, 16): q at even positions
    r = rot.rotate(x)[0, 0]
    score = lambda m, n: float(r[m] @ r[n])  # noqa: E731
    assert score(2, 7) == pytest.approx(score(6, 11), rel=1e-5)  # distance 5 both times
    assert score(2, 7) != pytest.approx(score(2, 9), rel=1e-3)
    assert torch.allclose(r[0], x[0, 0, 0])  # position 0 is not rotated


def test_rotary_turns_each_half_pair_forward_by_position_times_frequency():
    """Written out as complex numbers, independently of ``rope.py``: channel i and
    channel i + hs/2 of a head are one number x_i + j x_{i+hs/2}, multiplied by
    exp(j p w_i). That pins the pairing (rotate-half, not interleaved neighbours) and the
    direction, which published Llama weights depend on."""
    hs, T, theta = 8, 5, 10000.0
    x = torch.randn(1, 1, T, hs, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    got = Rotary(hs, theta).rotate(x.float()).double()[0, 0]
    w = [theta ** (-2 * i / hs) for i in range(hs // 2)]
    for p in range(T):
        for i in range(hs // 2):
            z = complex(x[0, 0, p, i], x[0, 0, p, i + hs // 2]) * complex(
                math.cos(p * w[i]), math.sin(p * w[i]))
            assert float(got[p, i]) == pytest.approx(z.real, abs=1e-5)
            assert float(got[p, i + hs // 2]) == pytest.approx(z.imag, abs=1e-5)


def test_rope_scaling():
    base = inverse_frequencies(64, 500000.0)
    assert torch.allclose(inverse_frequencies(64, 500000.0, "linear:4"), base / 4)
    llama3 = inverse_frequencies(64, 500000.0, "llama3:8:1:4:8192")
    wavelength = 2 * math.pi / base
    assert torch.equal(llama3[wavelength < 8192 / 4], base[wavelength < 8192 / 4])  # short
    assert torch.allclose(llama3[wavelength > 8192], base[wavelength > 8192] / 8)  # long
    for bad in ("cubic:2", "linear:0", "llama3:8:4:1:8192", "linear:x"):
        with pytest.raises(ValueError, match="rope_scaling"):
            inverse_frequencies(64, 1e4, bad)


def test_grouped_query_attention_is_attention_with_shared_heads():
    """With nkv = nh / 2, the model equals a multi-head one whose key/value heads are the
    grouped ones repeated (each serves two query heads)."""
    torch.manual_seed(0)
    gqa = GPT(_llama(n_kv_head=2))
    mha = GPT(_llama(n_kv_head=4))
    state = dict(gqa.state_dict())
    hs, C = 8, 32
    for i in range(2):
        w = state[f"h.{i}.attn.c_attn.weight"]
        q, k, v = w.split([4 * hs, 2 * hs, 2 * hs])
        repeat = lambda t: t.view(2, hs, C).repeat_interleave(2, dim=0).reshape(4 * hs, C)  # noqa: E731
        state[f"h.{i}.attn.c_attn.weight"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(state)
    x = torch.randint(0, 50, (2, 20))
    torch.testing.assert_close(gqa(x, x), mha(x, x), rtol=1e-6, atol=1e-6)


def test_rmsnorm():
    norm = RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8) * 5
    y = norm(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(3), atol=1e-4)


def test_untied_head_and_padding_leave_the_real_vocabulary_alone():
    """Padded rows of the head get no gradient and never appear in the logits."""
    torch.manual_seed(0)
    model = GPT(_llama())
    x = torch.randint(0, 50, (2, 16))
    model(x, x).backward()
    assert model.lm_head.weight.shape[0] == 64 and model.wte.weight.shape[0] == 64
    assert model.lm_head.weight.grad[50:].abs().max() == 0
    assert model.lm_head.weight[50:].abs().max() == 0
    assert model(x).shape == (2, 1, 50)


@pytest.mark.parametrize("option", [{"recompute": "block"}, {"loss_chunk": 7}])
def test_options_change_how_not_what(option):
    torch.manual_seed(0)
    plain = GPT(_llama())
    torch.manual_seed(0)
    other = GPT(_llama(**option))
    x, y = torch.randint(0, 50, (3, 32)), torch.randint(0, 50, (3, 32))
    lp, lo = plain(x, y), other(x, y)
    lp.backward()
    lo.backward()
    assert lp.item() == pytest.approx(lo.item(), rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), other.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_generation_and_block_size():
    model = GPT(_llama())

    class Chars:
        encode = staticmethod(lambda s: [ord(c) % 50 for c in s])
        decode = staticmethod(lambda ids: "".join(chr(65 + i % 26) for i in ids))

    assert len(model.complete(Chars, "ab", 5)) == 7
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of n_kv_head"):
        _llama(n_kv_head=3)
    with pytest.raises(ValueError, match="needs arch=llama"):
        GPTConfig(vocab_size=10, n_head=4, n_kv_head=2, n_embd=32)
    with pytest.raises(ValueError, match="must be even"):
        _llama(n_head=4, n_kv_head=4, n_embd=20)
