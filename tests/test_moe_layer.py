"""The mixture-of-experts layer in one process (``model/common/moe.py``): routing against
a token-by-token reference, the grouped and looped experts alike, the per-sequence
load-balancing loss independent of how a batch is cut, the capacity factor, counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import ConfigError, ModelConfig
from hpctrain.model.common.moe import MoE, moe_layers, set_loss_scale
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig


def moe_cfg(arch="llama", **kw) -> GPTConfig:
    shape = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
             "arch": arch, "moe_experts": 4, "moe_top_k": 2, **kw}
    return GPTConfig(**shape)


def built(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def token_by_token(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's output computed the slow, obvious way: each token through each of
    its top-k experts, weighted."""
    out = torch.zeros_like(x)
    ex = layer.experts
    for b in range(x.size(0)):
        for t in range(x.size(1)):
            v = x[b, t]
            logits = layer.router.weight @ v
            scores = torch.softmax(logits, -1) if layer.router_kind == "softmax" else torch.sigmoid(logits)
            top, chosen = torch.topk(scores, layer.top_k)
            if layer.norm_topk:
                top = top / top.sum()
            for w, e in zip(top, chosen):
                h = ex.activation((ex.w_in[e] @ v)[None])[0]
                out[b, t] += w * (ex.w_out[e] @ h)
            if hasattr(layer, "shared"):
                s = layer.shared(v[None, None])[0, 0]
                if hasattr(layer, "shared_gate"):
                    s = torch.sigmoid(layer.shared_gate.weight @ v) * s
                out[b, t] += s
    return out


@pytest.mark.parametrize("arch,router,norm,shared,gate", [
    ("llama", "softmax", True, 0, False), ("llama", "sigmoid", True, 1, False),
    ("gpt", "softmax", False, 2, False), ("llama", "softmax", False, 1, True)])
def test_the_layer_routes_each_token_to_its_top_k_experts(arch, router, norm, shared, gate):
    cfg = moe_cfg(arch, moe_router=router, moe_norm_topk=norm, moe_shared=shared,
                  moe_shared_gate=gate)
    layer = built(cfg).h[0].mlp
    x = torch.randn(2, 5, cfg.n_embd)
    torch.testing.assert_close(layer(x), token_by_token(layer, x), rtol=1e-5, atol=1e-6)


def test_grouped_and_looped_experts_compute_the_same():
    cfg = moe_cfg()
    model = built(cfg)
    x = torch.randint(0, 64, (3, 16))
    grads = []
    for grouped in (True, False):
        for layer in moe_layers(model):
            layer.experts.grouped = grouped
        model.zero_grad()
        model(x, x).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7)


def test_the_model_counts_its_parameters_total_and_active():
    cfg = moe_cfg(moe_shared=1, moe_shared_gate=True, moe_every=2, n_layer=4)
    model = built(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params(non_embedding=False)
    assert [type(b.mlp).__name__ for b in model.h] == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    dense = GPTConfig(**{**cfg.shape(), "moe_experts": 0, "moe_shared": 0,
                         "moe_shared_gate": False})
    per_expert = 3 * cfg.n_embd * cfg.ffn_hidden
    # a token uses top_k of the 4 experts: 2 fewer experts' weights per MoE block
    assert cfg.num_params() - cfg.active_params() == 2 * 2 * per_expert
    assert cfg.flops_per_token() < GPTConfig(**{**cfg.shape(), "moe_top_k": 4}).flops_per_token()
    assert dense.num_params() < cfg.active_params()


def _router_grad(model, batches, scale_each: float) -> torch.Tensor:
    model.zero_grad()
    set_loss_scale(model, scale_each)
    for x in batches:
        (model(x, x) * scale_each).backward()
    return torch.cat([layer.router.weight.grad.flatten() for layer in moe_layers(model)])


def test_the_balancing_loss_is_the_same_however_the_batch_is_cut():
    """Per sequence, then averaged: four micro-batches of one sequence, each scaled by
    1/4, give the gradient of one batch of four (the z-loss too)."""
    cfg = moe_cfg(moe_aux_loss=0.5, moe_z_loss=0.1)
    model = built(cfg)
    x = torch.randint(0, 64, (4, 16))
    whole = _router_grad(model, [x], 1.0)
    cut = _router_grad(model, list(x.chunk(4)), 0.25)
    torch.testing.assert_close(cut, whole, rtol=1e-5, atol=1e-8)


def test_the_balancing_loss_reaches_the_router_scaled_like_the_loss():
    """The auxiliary losses' gradient is coefficient x the runner's loss scale: twice the
    coefficient moves the router's gradient by the auxiliary part once more; without
    the loss scale (left at 1 while the loss is halved) the auxiliary part is doubled."""
    x = torch.randint(0, 64, (2, 16))
    g = {}
    for coef in (0.0, 1.0, 2.0):
        g[coef] = _router_grad(built(moe_cfg(moe_aux_loss=coef)), [x], 1.0)
    aux = g[1.0] - g[0.0]
    assert aux.abs().max() > 1e-6
    torch.testing.assert_close(g[2.0] - g[0.0], 2 * aux, rtol=1e-4, atol=1e-8)
    model = built(moe_cfg(moe_aux_loss=1.0))
    model.zero_grad()
    (model(x, x) * 0.5).backward()  # the loss scale not told to the layers
    unscaled = torch.cat([m.router.weight.grad.flatten() for m in moe_layers(model)])
    torch.testing.assert_close(unscaled, 0.5 * g[0.0] + aux, rtol=1e-4, atol=1e-8)


def test_the_balancing_loss_and_the_load_are_counted():
    """Equal scores (1/E each) give E sum_i f_i / E = 1 whatever the load; top-1 then
    sends all 16 copies to one expert (a tie), which the load shows."""
    cfg = moe_cfg(moe_top_k=1)
    layer = built(cfg).h[0].mlp
    torch.nn.init.zeros_(layer.router.weight)
    layer(torch.randn(2, 8, cfg.n_embd))
    values = layer.stats.values()
    assert sorted(values["load"]) == [0, 0, 0, 16]
    assert values["aux"] == pytest.approx(1.0)


def test_the_stats_count_training_forwards_only_once():
    cfg = moe_cfg(recompute="block")
    model = built(cfg)
    x = torch.randint(0, 64, (2, 16))
    model(x, x).backward()  # the block runs again in backward: not counted twice
    for layer in moe_layers(model):
        v = layer.stats.values()
        assert sum(v["load"]) == 2 * 16 * cfg.moe_top_k and v["passes"] == 1
    model.eval()
    with torch.no_grad():
        model(x, x)
    assert sum(moe_layers(model)[0].stats.values()["load"]) == 2 * 16 * cfg.moe_top_k


def test_a_capacity_factor_drops_and_counts_the_copies_over_it():
    cfg = moe_cfg(moe_top_k=1, moe_capacity=1.0)
    layer = built(cfg).h[0].mlp
    torch.nn.init.zeros_(layer.router.weight)  # all 16 copies to expert 0
    x = torch.randn(2, 8, cfg.n_embd)
    y = layer(x)
    cap = math.ceil(1.0 * 16 * 1 / 4)
    assert layer.stats.values()["dropped"] == 16 - cap
    # the first `cap` tokens (in order) kept, the rest get nothing from the experts
    flat = y.reshape(-1, cfg.n_embd)
    assert flat[cap:].abs().max() == 0 and flat[:cap].abs().max() > 0
    roomy = moe_cfg(moe_top_k=1, moe_capacity=4.0)  # room for every copy: dropless
    big, free = built(roomy).h[0].mlp, built(moe_cfg(moe_top_k=1)).h[0].mlp
    torch.testing.assert_close(big(x), free(x))


@pytest.mark.parametrize("override,words", [
    ({"moe_experts": 4, "moe_top_k": 5}, "moe_top_k=5"),
    ({"moe_shared": 1}, "set moe_experts > 0"),
    ({"moe_experts": 4, "moe_shared_gate": True}, "moe_shared > 0"),
    ({"moe_experts": 4, "moe_every": 9}, "moe_every=9 exceeds"),
    ({"moe_experts": 4, "moe_router": "relu"}, "is not one of"),
])
def test_moe_options_that_do_not_fit_are_refused_with_the_fix(override, words):
    with pytest.raises(ConfigError, match=words):
        ModelConfig(**override)


def test_a_gpt2_moe_block_uses_gelu_experts():
    cfg = moe_cfg("gpt", moe_ffn_hidden=24)
    layer = built(cfg).h[0].mlp
    assert tuple(layer.experts.w_in.shape) == (4, 24, cfg.n_embd)
    h = torch.randn(3, 24)
    torch.testing.assert_close(layer.experts.activation(h), F.gelu(h))
