"""``hpctrain ckpt import --from hf`` and the Llama export: Hugging Face GPT-2 and Llama
directories in and out.

The models are tiny, random and made here with ``transformers`` (nothing is
downloaded); their parameters are moved off their initial values (norms' ones, zero
biases) so that a mix-up of any two tensors shows. Tests that read safetensors or run
``transformers`` are marked ``hf`` (the hf leg); the refusals that happen before any
weight is read run everywhere.
"""

import json
import sys

import numpy as np
import pytest
import torch

from hpctrain.atomic import OutputError
from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.hf_import import import_hf
from hpctrain.checkpoint.sharded import CheckpointError, read_manifest
from hpctrain.checkpoint.weights import load_weights, model_options
from hpctrain.model.gpt import GPT, GPTConfig
from tests.helpers import (TEXTS, cpu_world, hpctrain_cmd, random_weights, run,
                           save_tokenizer, weights_checkpoint)

@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # local directories only: never the Hub


def _transformers():
    return pytest.importorskip("transformers")


def _moved(model):
    """``model`` with every parameter moved off its initialization."""
    with torch.random.fork_rng():
        torch.manual_seed(3)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _gpt2(directory, **overrides):
    t = _transformers()
    cfg = dict(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4,
               activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               bos_token_id=None, eos_token_id=None)
    model = _moved(t.GPT2LMHeadModel(t.GPT2Config(**{**cfg, **overrides})))
    model.save_pretrained(directory)
    return model


LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
"""With head size 8 and theta 500 the four wavelengths (6, 30, 140, 660 positions) fall
below, between and above the two thresholds (8 and 32): every branch of the rule."""


def _llama(directory, shard: str | None = None, **overrides):
    t = _transformers()
    cfg = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               rope_theta=500.0, tie_word_embeddings=False, bos_token_id=None,
               eos_token_id=None)
    cfg.update({k: dict(v) if isinstance(v, dict) else v for k, v in overrides.items()})
    model = _moved(t.LlamaForCausalLM(t.LlamaConfig(**cfg)))  # a copy: the config edits it
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model


def _ours(path) -> GPT:
    params, model, _ = load_weights(path)
    gpt = GPT(GPTConfig.from_shape(model))
    gpt.load_parameters(params)
    return gpt.eval()


def _logits(gpt: GPT, idx):
    with torch.no_grad():
        x = gpt.embed(idx)
        for block in gpt.h:
            x = block(x)
        return gpt.logits(x)


def _tokens(vocab: int, T: int):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(0))


# -------------------------------------------------------------- against transformers

@pytest.mark.hf
def test_gpt2_imports_with_the_logits_of_transformers(tmp_path):
    hf = _gpt2(tmp_path / "hf", vocab_size=save_tokenizer(tmp_path / "hf"))
    done = import_hf(tmp_path / "hf", tmp_path / "ckpt", vocab_multiple=8)
    assert done.model["arch"] == "gpt" and done.model["bias"] and done.model["tie_embeddings"]
    manifest = read_manifest(done.path)
    assert manifest.step == 0 and manifest.data["tokenizer"]["name"] == "hf"
    idx = _tokens(hf.config.vocab_size, 16)
    with torch.no_grad():
        want = hf(idx).logits
    torch.testing.assert_close(_logits(_ours(done.path), idx), want, atol=1e-5, rtol=1e-5)


@pytest.mark.hf
def test_published_gpt2_layout_imports_with_a_note_on_gelu(tmp_path):
    """OpenAI's gpt2 as published: names without ``transformer.``, the causal-mask
    buffers saved with the weights, and gelu_new (tanh), which hpctrain computes exactly:
    the note says so, and the logits stay close."""
    st = pytest.importorskip("safetensors.torch")
    hf = _gpt2(tmp_path / "hf", activation_function="gelu_new")
    state = st.load_file(tmp_path / "hf" / "model.safetensors")
    bare = {n.removeprefix("transformer."): t for n, t in state.items()}
    for i in range(2):
        bare[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
    st.save_file(bare, tmp_path / "hf" / "model.safetensors")
    done = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert any("gelu_new" in note for note in done.notes)
    idx = _tokens(61, 16)
    with torch.no_grad():
        want = hf(idx).logits
    got = _logits(_ours(done.path), idx)
    assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())


@pytest.mark.hf
@pytest.mark.parametrize("case", ["gqa-untied-llama3-sharded", "tied-with-biases"])
def test_llama_imports_with_the_logits_of_transformers(tmp_path, case):
    if case == "gqa-untied-llama3-sharded":
        hf = _llama(tmp_path / "hf", shard="20KB", rope_scaling=LLAMA3)
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    else:
        hf = _llama(tmp_path / "hf", num_key_value_heads=4, tie_word_embeddings=True,
                    attention_bias=True, mlp_bias=True)
    done = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    m = done.model
    assert m["arch"] == "llama" and m["n_kv_head"] == hf.config.num_key_value_heads
    assert m["tie_embeddings"] == (case == "tied-with-biases") == m["bias"]
    assert m["rope_scaling"] == ("llama3:4.0:1.0:4.0:32.0" if "llama3" in case else "")
    idx = _tokens(50, 64)
    with torch.no_grad():
        want = hf(idx).logits
    torch.testing.assert_close(_logits(_ours(done.path), idx), want, atol=1e-5, rtol=1e-5)


@pytest.mark.hf
def test_llama_export_loads_in_transformers_with_our_logits(tmp_path):
    t = _transformers()
    gpt_cfg = GPTConfig(vocab_size=45, block_size=32, n_layer=2, n_head=4, n_embd=32,
                        vocab_multiple=64, arch="llama", n_kv_head=2, ffn_hidden=40,
                        tie_embeddings=False, rope_theta=500.0,
                        rope_scaling="llama3:4.0:1.0:4.0:32.0", norm_eps=1e-6)
    weights = random_weights(gpt_cfg)
    out = ckpt_commands.export(weights_checkpoint(tmp_path / "ckpt", weights, gpt_cfg), "hf",
                               tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 8
    assert (config["num_key_value_heads"], config["intermediate_size"],
            config["tie_word_embeddings"], config["torch_dtype"]) == (2, 40, False, "float32")
    assert config["rope_scaling"] == {**LLAMA3}
    hf = t.LlamaForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert hf.dtype == torch.float32 and hf.lm_head.weight.shape[0] == 45  # padding cut off
    ours = GPT(gpt_cfg)
    ours.load_parameters(weights)
    idx = _tokens(45, 32)
    with torch.no_grad():
        got = hf(idx).logits
    torch.testing.assert_close(got, _logits(ours.eval(), idx), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------ round trip (safetensors only)

ROUND_TRIPS = {
    "gpt-without-biases": dict(arch="gpt", bias=False),
    "gpt-biases-untied": dict(arch="gpt", bias=True, tie_embeddings=False, norm_eps=1e-6,
                              ffn_hidden=48),
    "llama-gqa-untied-llama3": dict(arch="llama", n_kv_head=1, ffn_hidden=40,
                                    tie_embeddings=False, rope_theta=500.0,
                                    rope_scaling="linear:2.0"),
}


@pytest.mark.hf
@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_export_then_import_is_exact(tmp_path, case):
    pytest.importorskip("safetensors")
    gpt_cfg = GPTConfig(vocab_size=45, block_size=16, n_layer=2, n_head=2, n_embd=16,
                        vocab_multiple=8, **ROUND_TRIPS[case])
    weights = random_weights(gpt_cfg)
    if not gpt_cfg.bias:
        assert "h.0.ln_1.bias" not in weights
    ckpt = weights_checkpoint(tmp_path / "ckpt", weights, gpt_cfg)
    hf_dir = ckpt_commands.export(ckpt, "hf", tmp_path / "hf")
    back = import_hf(hf_dir, tmp_path / "back", vocab_multiple=8)
    params, model, _ = load_weights(back.path)
    assert model == gpt_cfg.shape()
    assert set(params) == set(weights)
    for name, p in weights.items():
        torch.testing.assert_close(params[name], p, atol=0, rtol=0)
    assert "verified" in ckpt_commands.inspect(back.path, verify=True)  # the zero moments' CRCs


@pytest.mark.hf
def test_a_tokenizer_goes_out_as_tokenizer_json_and_comes_back(tmp_path):
    pytest.importorskip("safetensors")  # the export's weights
    from hpctrain.data.tokenizers import HFTokenizer

    vocab = save_tokenizer(tmp_path / "tok")
    meta = HFTokenizer.from_file(tmp_path / "tok").meta()
    gpt_cfg = GPTConfig(vocab_size=vocab, block_size=8, n_layer=1, n_head=2, n_embd=8,
                        arch="llama", ffn_hidden=16)
    ckpt = weights_checkpoint(tmp_path / "ckpt", random_weights(gpt_cfg), gpt_cfg, meta)
    out = ckpt_commands.export(ckpt, "hf", tmp_path / "hf")
    assert (out / "tokenizer.json").read_text() == (tmp_path / "tok" / "tokenizer.json").read_text()
    back = import_hf(out, tmp_path / "back")
    assert read_manifest(back.path).data["tokenizer"]["sha256"] == meta["sha256"]


# ------------------------------------------------------------------------ refusals

def _config_only(directory, **config):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _nothing_written(parent, output):
    assert not output.exists()
    assert not [p for p in parent.iterdir() if p.name.startswith(".")]  # no temporaries


def test_pickle_weights_are_refused_unopened(tmp_path):
    src = _config_only(tmp_path / "hf", model_type="llama")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    with pytest.raises(CheckpointError, match=r"only as pickle \(pytorch_model.bin\), which "
                                              r"hpctrain never opens.*convert them to "
                                              "safetensors"):
        import_hf(src, tmp_path / "ckpt")
    _nothing_written(tmp_path, tmp_path / "ckpt")


def test_without_safetensors_the_message_says_how_to_install(tmp_path, monkeypatch):
    src = _config_only(tmp_path / "hf", model_type="gpt2")
    (src / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # as if not installed
    with pytest.raises(CheckpointError, match=r"safetensors package: `pip install safetensors`"):
        import_hf(src, tmp_path / "ckpt")
    _nothing_written(tmp_path, tmp_path / "ckpt")


@pytest.mark.parametrize("damage,message", [
    ("no dir", "is not a directory"),
    ("no config", "has no config.json"),
    ("not json", "is not readable JSON"),
    ("mistral", "model_type 'mistral' is not one hpctrain imports; it imports gpt2, llama, "
                "mixtral, qwen2_moe"),
    ("no weights", "has neither model.safetensors nor model.safetensors.index.json"),
    ("index outside", "names '../x.safetensors' for lm_head.weight, not a .safetensors file "
                      "beside it"),
    ("output exists", "exists; choose a new --output directory")])
def test_bad_directories_are_one_error_and_write_nothing(tmp_path, damage, message):
    src = tmp_path / "hf"
    if damage != "no dir":
        src.mkdir()
    if damage not in ("no dir", "no config"):
        kind = "mistral" if damage == "mistral" else "llama"
        (src / "config.json").write_text("{" if damage == "not json"
                                         else json.dumps({"model_type": kind}))
    if damage == "index outside":
        (src / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    out = tmp_path / "out" / "ckpt"
    if damage == "output exists":
        out.mkdir(parents=True)
        (out / "mine.txt").write_text("kept")
    with pytest.raises(CheckpointError, match=message):
        import_hf(src, out)
    if damage == "output exists":
        assert (out / "mine.txt").read_text() == "kept"
    else:
        assert not out.parent.exists()


def test_a_write_that_fails_halfway_leaves_nothing(tmp_path, monkeypatch):
    import hpctrain.checkpoint.weights as weights

    real = weights.write_shard

    def full_disk(path, *args, **kwargs):
        real(path, *args, **kwargs)  # the shard is on disk, then the manifest fails
        raise RuntimeError("Can't write data (file write failed: No space left on device)")

    monkeypatch.setattr(weights, "write_shard", full_disk)
    gpt_cfg = GPTConfig(vocab_size=10, block_size=4, n_layer=1, n_head=1, n_embd=4)
    with pytest.raises(OutputError, match=r"writing .*ckpt failed: No space left on device; "
                                          "make room"):
        weights_checkpoint(tmp_path / "ckpt", random_weights(gpt_cfg), gpt_cfg)
    _nothing_written(tmp_path, tmp_path / "ckpt")


@pytest.mark.hf
@pytest.mark.parametrize("damage,message", [
    ("wider config", r"transformer.wte.weight has shape \[61, 32\], but config.json implies "
                     r"\[61, 48\]"),
    ("missing tensor", r"lacks transformer.h.1.mlp.c_proj.weight, which config.json implies"),
    ("extra tensor", r"has tensors a plain gpt model does not: transformer.adapter.weight"),
    ("relu", r"activation_function 'relu' is not GELU")])
def test_weights_that_do_not_fit_the_config_write_nothing(tmp_path, damage, message):
    st = pytest.importorskip("safetensors.torch")
    _gpt2(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    weights = tmp_path / "hf" / "model.safetensors"
    state = st.load_file(weights)
    if damage == "wider config":
        config["n_embd"] = 48
    elif damage == "relu":
        config["activation_function"] = "relu"
    elif damage == "missing tensor":
        del state["transformer.h.1.mlp.c_proj.weight"]
    else:
        state["transformer.adapter.weight"] = torch.zeros(2)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    st.save_file(state, weights)
    with pytest.raises(CheckpointError, match=message):
        import_hf(tmp_path / "hf", tmp_path / "ckpt")
    _nothing_written(tmp_path, tmp_path / "ckpt")


@pytest.mark.slow
def test_the_command_exits_2_with_one_line_naming_the_fix(tmp_path):
    src = _config_only(tmp_path / "hf", model_type="gpt2")
    (src / "model.bin").write_bytes(b"x")
    p = run(hpctrain_cmd("ckpt", "import", "--from", "hf", str(src), "--output",
                         str(tmp_path / "ckpt")))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.count("\n") == 1 and "convert them to safetensors" in p.stderr


# ----------------------------------------------------------- the user's whole path

@pytest.mark.hf
@pytest.mark.slow
def test_import_prepare_and_fine_tune_start_from_the_published_model(tmp_path):
    """import -> prepare --tokenizer hf:DIR -> train --train.init_from: the first step's
    loss is the Hugging Face model's own loss on that batch, and `hpctrain sample`
    decodes with the imported tokenizer."""
    from mpi4py import MPI

    from hpctrain.data.dataset import TokenDataset
    from hpctrain.data.prepare import prepare
    from hpctrain.data.sampler import make_sampler
    from hpctrain.train.trainer import Trainer
    from tests.helpers import tiny_config

    vocab = save_tokenizer(tmp_path / "hf")
    hf = _llama(tmp_path / "hf", vocab_size=vocab, rope_scaling=LLAMA3)
    p = run(hpctrain_cmd("ckpt", "import", "--from", "hf", str(tmp_path / "hf"),
                         "--output", str(tmp_path / "ckpt")), timeout=120)
    assert p.returncode == 0, p.stderr
    assert "fine-tune it: hpctrain train" in p.stdout and "--model.arch=llama" in p.stdout
    for i, text in enumerate(TEXTS):
        (tmp_path / f"{i}.txt").write_text(text * 40)
    data = prepare([str(tmp_path / f"{i}.txt") for i in range(3)], tmp_path / "d.h5",
                   tokenizer=f"hf:{tmp_path / 'hf'}", show_progress=False)["output"]
    _, model, _ = load_weights(tmp_path / "ckpt")
    opts = {o.split("=", 1)[0][2:]: o.split("=", 1)[1] for o in model_options(model)}
    opts["model.block_size"] = "16"  # train on shorter windows than the model's 64
    cfg = tiny_config(data, tmp_path / "run", **opts, **{
        "train.init_from": str(tmp_path / "ckpt"), "train.max_iters": 2})
    result = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    ds = TokenDataset(data)
    sampler = make_sampler(cfg.data.sampler, ds.splits["train"].n_tokens, 16,
                           cfg.train.batch_size, cfg.train.seed)
    tokens = torch.from_numpy(ds.read("train", sampler.global_starts(0), 17)).long()
    ds.close()
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    np.testing.assert_allclose(result.losses[0], float(want), atol=1e-5, rtol=0)
    p = run(hpctrain_cmd("sample", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def ",
                         "--tokens", "5"), timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("def "), p.stderr
