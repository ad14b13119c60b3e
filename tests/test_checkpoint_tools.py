"""``hpctrain ckpt inspect | merge | export`` and sampling from a sharded checkpoint."""

import json

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.single_file import load_single_file
from hpctrain.model.gpt import GPT
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, hpctrain_cmd, read_safetensors_by_hand, run, tiny_config


@pytest.fixture(scope="module")
def trained(dataset_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt-tools")
    cfg = tiny_config(dataset_path, out, **{"parallel.zero": 3, "train.ckpt_interval": 10,
                                            "train.save_checkpoint": True, "model.bias": True,
                                            "train.max_iters": 20})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    trainer.fit()
    with trainer.engine.gathered():
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.close()
    return out, trainer.gpt_cfg, params


def _model(gpt_cfg, params):
    model = GPT(gpt_cfg)
    state = dict(params, **{"lm_head.weight": params["wte.weight"]})
    model.load_state_dict(state)
    return model.eval()


def test_inspect_names_step_layout_and_verifies(trained):
    out, _, _ = trained
    text = ckpt_commands.inspect(out, verify=True)
    assert "step 20" in text and "zero layout" in text and "ZeRO level 3" in text
    assert "verified" in text


def test_merge_writes_the_single_file_format(trained, tmp_path):
    out, _, params = trained
    merged = load_single_file(ckpt_commands.merge(out, tmp_path / "m.h5"))
    assert merged.step == 20 and merged.tokenizer["name"] == "char"
    for name, p in params.items():
        np.testing.assert_array_equal(merged.model[name], p.numpy())
        assert set(merged.optim[name]) == {"exp_avg", "exp_avg_sq", "step"}


def _unpadded(gpt_cfg, params):
    """The weights an export holds: the embedding without its padded rows."""
    assert params["wte.weight"].shape[0] == gpt_cfg.padded_vocab_size > gpt_cfg.vocab_size
    return {**params, "wte.weight": params["wte.weight"][:gpt_cfg.vocab_size]}


def test_safetensors_export_reads_back(trained, tmp_path):
    out, gpt_cfg, params = trained
    path = ckpt_commands.export(out, "safetensors", tmp_path / "w.safetensors")
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for name, p in _unpadded(gpt_cfg, params).items():
        a, b = header[name]["data_offsets"]
        got = np.frombuffer(raw[8 + n + a:8 + n + b], dtype="<f4").reshape(header[name]["shape"])
        np.testing.assert_array_equal(got, p.numpy())


@pytest.mark.hf
def test_safetensors_package_reads_the_export(trained, tmp_path):
    safetensors = pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    out, gpt_cfg, params = trained
    params = _unpadded(gpt_cfg, params)
    path = ckpt_commands.export(out, "safetensors", tmp_path / "w.safetensors")
    got = load_file(path)
    assert set(got) == set(params)
    for name, p in params.items():
        assert got[name].dtype == p.dtype
        torch.testing.assert_close(got[name], p, atol=0, rtol=0)
    with safetensors.safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "hpctrain_step": "20"}


@pytest.mark.hf
def test_safetensors_package_reads_every_dtype_and_shape_we_write(tmp_path):
    """The writer's corners: each dtype it knows, a scalar, an empty tensor, a transposed
    (non-contiguous) one, and names that do not sort as they were given."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    from hpctrain.checkpoint.export import write_safetensors

    tensors = {"z.half": torch.linspace(-2, 2, 12, dtype=torch.float16).reshape(3, 4),
               "a.step": torch.tensor(7, dtype=torch.int64),
               "m.empty": torch.zeros(0, 5),
               "b.t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}
    got = load_file(write_safetensors(tmp_path / "x.safetensors", tensors))
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        torch.testing.assert_close(got[name], t, atol=0, rtol=0)


@pytest.mark.hf
def test_hugging_face_export_gives_the_same_logits(trained, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local directory: never the Hub
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from hpctrain.checkpoint.hf_names import to_hf

    out, gpt_cfg, params = trained
    hf_dir = ckpt_commands.export(out, "hf", tmp_path / "hf")
    state = load_file(hf_dir / "model.safetensors")
    expected_state = to_hf(params, gpt_cfg.shape())
    assert set(state) == set(expected_state)
    for name, t in expected_state.items():
        torch.testing.assert_close(state[name], t, atol=0, rtol=0)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, local_files_only=True).eval()
    assert hf.dtype == torch.float32
    ours = _model(gpt_cfg, params)
    idx = torch.randint(0, gpt_cfg.vocab_size, (2, gpt_cfg.block_size),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.logits(_hidden(ours, idx))
        got = hf(idx).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _hidden(model, idx):
    x = model.embed(idx)
    for block in model.h:
        x = block(x)
    return x


@pytest.mark.slow  # a subprocess
def test_sample_reads_a_sharded_checkpoint(trained):
    out, _, _ = trained
    p = run(hpctrain_cmd("sample", "--checkpoint", str(out / "checkpoints" / "step_000010"),
                         "--prompt", "def ", "--tokens", "20"))
    assert p.returncode == 0 and p.stdout.startswith("def "), p.stderr
    p = run(hpctrain_cmd("ckpt", "inspect", str(out / "nothing-here")))
    assert p.returncode == 2 and "not a complete checkpoint" in p.stderr


@pytest.mark.parametrize("world,zero", [(1, 1), (3, 2), (2, 0)])
def test_reshard_writes_a_checkpoint_for_another_layout(trained, tmp_path, world, zero):
    out, gpt_cfg, params = trained
    new = ckpt_commands.reshard(out, tmp_path / "new", world=world, zero=zero)
    assert f"{world} rank(s)" in ckpt_commands.inspect(new, verify=True)
    from hpctrain.checkpoint.sharded import read_full_state, read_manifest

    for name, s in read_full_state(read_manifest(new)).items():
        torch.testing.assert_close(s["param"], params[name], atol=0, rtol=0)
    with pytest.raises(Exception, match="exists"):
        ckpt_commands.reshard(out, new, world=world, zero=zero)


def test_resharded_checkpoint_resumes_with_its_own_layout(dataset_path, trained, tmp_path,
                                                          monkeypatch):
    out, _, _ = trained
    new = ckpt_commands.reshard(out / "checkpoints" / "step_000010", tmp_path / "z1", world=1,
                                zero=1, bucket_mb=0.02, first_bucket_mb=0.005)
    import hpctrain.checkpoint.distributed as distributed

    def no_reshuffle(*args, **kwargs):
        raise AssertionError("the resharded checkpoint should load shard by shard")

    monkeypatch.setattr(distributed, "_load_resharded", no_reshuffle)
    cfg = tiny_config(dataset_path, tmp_path / "run", **{
        "parallel.zero": 1, "parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005,
        "train.resume": str(new), "model.bias": True, "train.max_iters": 20})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert trainer.start.step == 10 and len(trainer.fit().losses) == 10


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["no model", "other width"])
def test_sample_from_a_final_h5_whose_recorded_shape_lies_is_one_clean_error(trained, tmp_path,
                                                                           damage):
    import shutil

    import h5py

    out, _, _ = trained
    final = tmp_path / "final.h5"
    shutil.copy(out / "final.h5", final)
    with h5py.File(final, "r+") as f:
        config = json.loads(f.attrs["config"])
        if damage == "no model":
            del config["model"]
        else:
            config["model"]["n_embd"] *= 2
        f.attrs["config"] = json.dumps(config)
    p = run(hpctrain_cmd("sample", "--checkpoint", str(final), "--tokens", "5"), timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "damaged" in p.stderr


def test_gpt2_export_stores_conv1d_weights_transposed(tmp_path):
    """GPT-2's Conv1D keeps (in, out): the exported c_attn, c_proj and c_fc are our Linear
    weights transposed, the embeddings as they are (the same check the hf leg makes
    through transformers' logits, without transformers)."""
    from hpctrain.checkpoint.export import export_hf
    from hpctrain.model.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=40, block_size=8, n_layer=1, n_head=2, n_embd=16, bias=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    params = {n: p.detach() for n, p in model.named_parameters()}
    export_hf(tmp_path / "hf", params, cfg.shape(), None)
    hf = read_safetensors_by_hand(tmp_path / "hf" / "model.safetensors")
    for ours in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        w = params[f"h.0.{ours}.weight"]
        theirs = hf[f"transformer.h.0.{ours}.weight"]
        assert theirs.shape == (w.shape[1], w.shape[0]), ours
        torch.testing.assert_close(theirs, w.t(), rtol=0, atol=0)
    torch.testing.assert_close(hf["transformer.wte.weight"], params["wte.weight"][:40])
