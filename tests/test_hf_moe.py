"""Mixture-of-experts models in and out of Hugging Face: ``MixtralForCausalLM`` and
``Qwen2MoeForCausalLM`` (``checkpoint/hf_names.py``, ``hf_config.py``).

The transformers models are tiny (2 layers, 4 experts, top-2), random, made here and
moved off their initial values (``test_hf_import._moved``) so that a mix-up of any two
tensors shows; the tests that run transformers or read safetensors are marked ``hf``.
The name table, the refusals of models no layout computes and of configs hpctrain
cannot follow run everywhere.
"""

import json

import pytest
import torch

from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.dcp_names import rules as dcp_rules
from hpctrain.checkpoint.hf_config import from_hf_config, hf_layout, to_hf_config
from hpctrain.checkpoint.hf_import import import_hf
from hpctrain.checkpoint.hf_names import from_hf, to_hf
from hpctrain.checkpoint.sharded import CheckpointError
from hpctrain.checkpoint.weights import load_weights
from hpctrain.model.gpt import GPT, GPTConfig
from tests.helpers import random_weights, weights_checkpoint
from tests.test_hf_import import _logits, _moved, _ours, _tokens


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local directories only: never the Hub


SIZES = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, rope_theta=500.0,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _mixtral(directory, **overrides):
    t = pytest.importorskip("transformers")
    cfg = {**SIZES, "intermediate_size": 16, "num_local_experts": 4,
           "num_experts_per_tok": 2, "router_jitter_noise": 0.0, **overrides}
    model = _moved(t.MixtralForCausalLM(t.MixtralConfig(**cfg)))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def _qwen2_moe(directory, **overrides):
    t = pytest.importorskip("transformers")
    cfg = {**SIZES, "intermediate_size": 40, "moe_intermediate_size": 16,
           "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
           **overrides}
    model = _moved(t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**cfg)))
    model.save_pretrained(directory, safe_serialization=True)
    return model


def moe_cfg(**kw) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 45, "block_size": 32, "n_layer": 2, "n_head": 4,
                        "n_embd": 32, "arch": "llama", "n_kv_head": 2, "ffn_hidden": 40,
                        "vocab_multiple": 8, "tie_embeddings": False, "rope_theta": 500.0,
                        "moe_experts": 4, "moe_top_k": 2, "moe_ffn_hidden": 16, **kw})


MIXTRAL = dict(moe_ffn_hidden=0, ffn_hidden=16)
QWEN = dict(moe_shared=2, moe_shared_gate=True, moe_norm_topk=False, qkv_bias=True)
QWEN_SPARSE = dict(moe_shared=1, moe_shared_gate=True, moe_every=2, tie_embeddings=True)
"""Qwen2-MoE every other block, without q/k/v biases (exported as zeros)."""


# -------------------------------------------------------------- against transformers

@pytest.mark.hf
def test_mixtral_imports_with_the_logits_of_transformers(tmp_path):
    hf = _mixtral(tmp_path / "hf")
    done = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    m = done.model
    assert (m["moe_experts"], m["moe_top_k"], m["moe_every"], m["moe_shared"]) == (4, 2, 1, 0)
    assert m["moe_router"] == "softmax" and m["moe_norm_topk"] and not m["qkv_bias"]
    idx = _tokens(50, 32)
    with torch.no_grad():
        want = hf(idx).logits
    torch.testing.assert_close(_logits(_ours(done.path), idx), want, atol=1e-5, rtol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize("case", ["every-block", "every-other-block-tied-normalised"])
def test_qwen2_moe_imports_with_the_logits_of_transformers(tmp_path, case):
    if case == "every-block":
        hf = _qwen2_moe(tmp_path / "hf")
    else:  # layer 0 dense (mlp_only_layers agrees with decoder_sparse_step), layer 1 MoE
        hf = _qwen2_moe(tmp_path / "hf", decoder_sparse_step=2, mlp_only_layers=[0],
                        norm_topk_prob=True, tie_word_embeddings=True,
                        shared_expert_intermediate_size=48)
    done = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    m = done.model
    assert m["qkv_bias"] and m["moe_shared_gate"] and m["moe_ffn_hidden"] == 16
    assert (m["moe_every"], m["moe_shared"], m["moe_norm_topk"]) == (
        (1, 2, False) if case == "every-block" else (2, 3, True))
    idx = _tokens(50, 32)
    with torch.no_grad():
        want = hf(idx).logits
    torch.testing.assert_close(_logits(_ours(done.path), idx), want, atol=1e-5, rtol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize("case,fields,cls", [
    ("mixtral", MIXTRAL, "MixtralForCausalLM"), ("qwen2-moe", QWEN, "Qwen2MoeForCausalLM"),
    ("qwen2-moe-sparse", QWEN_SPARSE, "Qwen2MoeForCausalLM")])
def test_moe_export_loads_in_transformers_with_our_logits(tmp_path, case, fields, cls):
    t = pytest.importorskip("transformers")
    gpt_cfg = moe_cfg(**fields)
    weights = random_weights(gpt_cfg)
    out = ckpt_commands.export(weights_checkpoint(tmp_path / "ckpt", weights, gpt_cfg), "hf",
                               tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]
    hf, info = t.AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                      output_loading_info=True)
    assert type(hf).__name__ == cls
    assert not any(info.values()), info  # nothing missing, unexpected or misshapen
    ours = GPT(gpt_cfg)
    ours.load_parameters(weights)
    idx = _tokens(45, 32)
    with torch.no_grad():
        got = hf.eval()(idx).logits
    torch.testing.assert_close(got, _logits(ours.eval(), idx), atol=1e-5, rtol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize("fields", [MIXTRAL, QWEN, QWEN_SPARSE], ids=["mixtral", "qwen2-moe",
                                                                     "qwen2-moe-sparse"])
def test_moe_export_then_import_is_exact(tmp_path, fields):
    pytest.importorskip("safetensors")
    gpt_cfg = moe_cfg(**fields)
    weights = random_weights(gpt_cfg)
    hf_dir = ckpt_commands.export(weights_checkpoint(tmp_path / "ckpt", weights, gpt_cfg),
                                  "hf", tmp_path / "hf")
    back = import_hf(hf_dir, tmp_path / "back", vocab_multiple=8)
    params, model, _ = load_weights(back.path)
    assert model == gpt_cfg.shape()  # QWEN_SPARSE's zero q/k/v biases: qkv_bias=false again
    assert set(params) == set(weights)
    for name, p in weights.items():
        torch.testing.assert_close(params[name], p, atol=0, rtol=0)


@pytest.mark.hf
def test_an_unrepresentable_qwen2_moe_writes_nothing(tmp_path):
    pytest.importorskip("safetensors")
    _qwen2_moe(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["shared_expert_intermediate_size"] = 24
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: shared_expert_intermediate_size "
                                              r"24 is not a multiple of moe_intermediate_size"):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ the name table

def test_each_expert_takes_its_own_gate_up_and_down_rows():
    """Expert e's w1 (gate) is w_in[e, :H], w3 (up) w_in[e, H:], w2 (down) w_out[e]:
    in both layouts, both ways."""
    for fields, prefix, names in ((MIXTRAL, "block_sparse_moe", ("w1", "w3", "w2")),
                                  (QWEN, "mlp", ("gate_proj", "up_proj", "down_proj"))):
        cfg = moe_cfg(**fields)
        H = cfg.moe_ffn_hidden or cfg.ffn_hidden
        weights = random_weights(cfg)
        hf = to_hf(weights, cfg.shape())
        w_in, w_out = weights["h.1.mlp.experts.w_in"], weights["h.1.mlp.experts.w_out"]
        for e in range(cfg.moe_experts):
            theirs = f"model.layers.1.{prefix}.experts.{e}"
            assert torch.equal(hf[f"{theirs}.{names[0]}.weight"], w_in[e, :H])
            assert torch.equal(hf[f"{theirs}.{names[1]}.weight"], w_in[e, H:])
            assert torch.equal(hf[f"{theirs}.{names[2]}.weight"], w_out[e])
        assert torch.equal(hf[f"model.layers.1.{prefix}.gate.weight"],
                           weights["h.1.mlp.router.weight"])
        back = from_hf(hf, cfg.shape())
        assert set(back) == set(weights)
        for name, p in weights.items():
            assert torch.equal(back[name], p), name


def test_qwen2_moe_names_its_shared_expert_and_the_dense_blocks():
    cfg = moe_cfg(**QWEN_SPARSE)
    weights = random_weights(cfg)
    hf = to_hf(weights, cfg.shape())
    shared, c_fc = "model.layers.1.mlp.shared_expert", weights["h.1.mlp.shared.c_fc.weight"]
    assert torch.equal(hf[f"{shared}.gate_proj.weight"], c_fc[:16])
    assert torch.equal(hf[f"{shared}.up_proj.weight"], c_fc[16:])
    assert torch.equal(hf["model.layers.1.mlp.shared_expert_gate.weight"],
                       weights["h.1.mlp.shared_gate.weight"])
    assert torch.equal(hf["model.layers.0.mlp.up_proj.weight"],
                       weights["h.0.mlp.c_fc.weight"][40:])  # block 0 is dense
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in hf)
    assert not hf["model.layers.0.self_attn.q_proj.bias"].any()  # no qkv_bias: zeros
    config = to_hf_config(cfg.shape())
    assert (config["decoder_sparse_step"], config["shared_expert_intermediate_size"],
            config["intermediate_size"], config["moe_intermediate_size"]) == (2, 16, 40, 16)


def test_qkv_bias_reaches_the_attention():
    cfg = moe_cfg(**QWEN)
    names = dict(GPT(cfg).named_parameters())
    assert names["h.0.attn.c_attn.bias"].shape == (32 + 2 * 16,)
    assert "h.0.attn.c_proj.bias" not in names
    assert sum(p.numel() for p in names.values()) == cfg.num_params(non_embedding=False)


# ------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("fields,message", [
    (dict(moe_router="sigmoid"), r"moe_router='sigmoid' has no Hugging Face form"),
    (dict(moe_every=2), r"moe_every=2 has no Hugging Face form"),
    (dict(moe_norm_topk=False), r"moe_norm_topk=False has no Hugging Face form"),
    (dict(qkv_bias=True), r"qkv_bias=True has no Hugging Face form"),
    (dict(moe_shared=1), r"moe_shared_gate=False has no Hugging Face form"),
    (dict(bias=True, moe_shared=1, moe_shared_gate=True), r"bias=True has no Hugging Face"),
    (dict(arch="gpt", n_kv_head=0), r"a gpt model with experts has no Hugging Face form"),
    (dict(moe_experts=0, qkv_bias=True), r"qkv_bias=true .* has no LlamaForCausalLM form")])
def test_models_no_layout_computes_are_refused_by_name(fields, message):
    with pytest.raises(CheckpointError, match=message + ".*--format safetensors"):
        hf_layout(moe_cfg(**fields))


def test_an_unexportable_model_writes_nothing(tmp_path):
    pytest.importorskip("h5py")
    cfg = moe_cfg(moe_router="sigmoid")
    ckpt = weights_checkpoint(tmp_path / "ckpt", random_weights(cfg), cfg)
    with pytest.raises(CheckpointError, match="moe_router='sigmoid'"):
        ckpt_commands.export(ckpt, "hf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointError, match="experts .* has no torchtitan llama3 form"):
        ckpt_commands.export(ckpt, "dcp", tmp_path / "dcp")
    assert not (tmp_path / "dcp").exists()


def test_a_gpt_with_experts_keeps_its_own_names_in_dcp():
    cfg = moe_cfg(arch="gpt", n_kv_head=0)
    assert [r.theirs for r in dcp_rules(cfg.shape())][:3] == [("wte.weight",), ("wpe.weight",),
                                                              ("h.0.ln_1.weight",)]
    assert ("h.0.mlp.experts.w_in",) in [r.theirs for r in dcp_rules(cfg.shape())]


QWEN_CONFIG = dict(SIZES, model_type="qwen2_moe", intermediate_size=40,
                   moe_intermediate_size=16, shared_expert_intermediate_size=32,
                   num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("change,message", [
    (dict(shared_expert_intermediate_size=24), r"shared_expert_intermediate_size 24 is not "
                                               r"a multiple of moe_intermediate_size 16"),
    (dict(decoder_sparse_step=2, mlp_only_layers=[1]), r"mlp_only_layers makes layer 1 dense"),
    (dict(decoder_sparse_step=3), r"decoder_sparse_step 3 exceeds num_hidden_layers 2"),
    (dict(num_experts=0), r"num_experts is 0"),
    (dict(use_sliding_window=True), r"use_sliding_window is true"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu' is not 'silu'"),
    (dict(model_type="mixtral", sliding_window=16), r"sliding_window 16 is shorter than "
                                                    r"max_position_embeddings 32"),
    (dict(model_type="deepseek_v3"), r"model_type 'deepseek_v3' is not one hpctrain imports")])
def test_configs_hpctrain_cannot_follow_are_refused_by_key(change, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config({**QWEN_CONFIG, **change}, bias=True)


def test_mixtral_router_jitter_imports_with_a_note():
    config = dict(SIZES, model_type="mixtral", intermediate_size=16, num_local_experts=4,
                  num_experts_per_tok=2, router_jitter_noise=0.1, sliding_window=None)
    model, notes = from_hf_config(config, bias=False)
    assert model["moe_experts"] == 4 and model["moe_norm_topk"]
    assert len(notes) == 1 and "router_jitter_noise is 0.1" in notes[0]
