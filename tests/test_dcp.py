"""``hpctrain ckpt export --format dcp`` and ``ckpt import --from dcp``: torch Distributed
Checkpoint directories, read and written by torch's own ``torch.distributed.checkpoint``."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.dcp import import_dcp
from hpctrain.checkpoint.hf_config import to_hf_config
from hpctrain.checkpoint.sharded import CheckpointError, read_full_state, read_manifest
from hpctrain.cli import main
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig
from hpctrain.train.trainer import Trainer
from tests.helpers import LLAMA, cpu_world, hpctrain_cmd, run, tiny_config
from tests.titan_llama import TitanLlama

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _train(dataset_path, out, **extra):
    cfg = tiny_config(dataset_path, out, **{"train.max_iters": 4, "train.ckpt_interval": 4,
                                            "train.save_checkpoint": True,
                                            "model.vocab_multiple": 8, **extra})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    trainer.fit()
    trainer.close()
    return out, trainer.gpt_cfg


@pytest.fixture(scope="module")
def llama(dataset_path, tmp_path_factory):
    return _train(dataset_path, tmp_path_factory.mktemp("dcp-llama"), **LLAMA)


@pytest.fixture(scope="module")
def gpt2(dataset_path, tmp_path_factory):
    return _train(dataset_path, tmp_path_factory.mktemp("dcp-gpt"), **{"model.bias": True})


def _plain_load(path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, by plain ``torch.distributed.checkpoint``."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in md.state_dict_metadata.items() if hasattr(v, "size")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _interleave(t, heads):
    """Half-split rotary rows -> torchtitan's interleaved pairs, written out by hand:
    row 2i of a head is our row i, row 2i + 1 our row i + hs/2."""
    hs = t.shape[0] // heads
    order = [h * hs + (i // 2 if i % 2 == 0 else hs // 2 + i // 2)
             for h in range(heads) for i in range(hs)]
    return t[order]


def _torchtitan(full: dict, key: str, cfg) -> dict[str, torch.Tensor]:
    """Our ``key`` tensors in torchtitan's llama3 names and layout, built here by hand."""
    C, V, H = cfg.n_embd, cfg.vocab_size, cfg.ffn_hidden
    q, kv = cfg.n_head * cfg.head_size, cfg.n_kv_head * cfg.head_size
    out = {"tok_embeddings.weight": full["wte.weight"][key][:V],
           "output.weight": full["lm_head.weight"][key][:V],
           "norm.weight": full["ln_f.weight"][key]}
    for i in range(cfg.n_layer):
        a, m = f"layers.{i}.attention", f"layers.{i}.feed_forward"
        attn = full[f"h.{i}.attn.c_attn.weight"][key]
        assert attn.shape == (q + 2 * kv, C)
        out[f"{a}.wq.weight"] = _interleave(attn[:q], cfg.n_head)
        out[f"{a}.wk.weight"] = _interleave(attn[q:q + kv], cfg.n_kv_head)
        out[f"{a}.wv.weight"] = attn[q + kv:]
        out[f"{a}.wo.weight"] = full[f"h.{i}.attn.c_proj.weight"][key]
        fc = full[f"h.{i}.mlp.c_fc.weight"][key]
        out[f"{m}.w1.weight"], out[f"{m}.w3.weight"] = fc[:H], fc[H:]
        out[f"{m}.w2.weight"] = full[f"h.{i}.mlp.c_proj.weight"][key]
        out[f"layers.{i}.attention_norm.weight"] = full[f"h.{i}.ln_1.weight"][key]
        out[f"layers.{i}.ffn_norm.weight"] = full[f"h.{i}.ln_2.weight"][key]
    return out


def test_llama_export_holds_torchtitan_names_and_every_tensor(llama, tmp_path):
    out, cfg = llama
    assert cfg.n_kv_head < cfg.n_head and not cfg.tie_embeddings
    path = ckpt_commands.export(out, "dcp", tmp_path / "dcp")
    got = _plain_load(path)
    m = read_manifest(out)
    full = read_full_state(m)
    params = _torchtitan(full, "param", cfg)
    optim = {f"optimizer.state.{n}.{k}": t for k in ("exp_avg", "exp_avg_sq")
             for n, t in _torchtitan(full, k, cfg).items()}
    steps = {f"optimizer.state.{n}.step": torch.tensor(float(m.data["optimizer_step"]))
             for n in params}
    want = {**params, **optim, **steps}
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    assert float(m.data["optimizer_step"]) == 4
    side = json.loads((path / "hpctrain_dcp.json").read_text())
    assert side["model"] == m.data["model"] and side["step"] == 4


def test_gpt2_export_keeps_our_names(gpt2, tmp_path):
    out, cfg = gpt2
    path = ckpt_commands.export(out, "dcp", tmp_path / "dcp")
    got = _plain_load(path)
    full = read_full_state(read_manifest(out))
    for name, s in full.items():
        rows = cfg.vocab_size if name == "wte.weight" else s["param"].shape[0]
        for key, prefix in (("param", ""), ("exp_avg", "optimizer.state."),
                            ("exp_avg_sq", "optimizer.state.")):
            k = f"{prefix}{name}" + (f".{key}" if prefix else "")
            torch.testing.assert_close(got[k], s[key][:rows], rtol=0, atol=0, msg=k)
    assert len([k for k in got if not k.startswith("optimizer.")]) == len(full)


def _logits(params, cfg):
    model = GPT(cfg)
    state = dict(params)
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["wte.weight"]
    model.load_state_dict(state, strict=False)
    x = torch.arange(12).reshape(2, 6) % cfg.vocab_size
    with torch.no_grad():
        return model.eval()(x)


@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_round_trip_gives_the_weights_and_logits_back(which, request, tmp_path):
    out, cfg = request.getfixturevalue(which)
    path = ckpt_commands.export(out, "dcp", tmp_path / "dcp")
    done = import_dcp(path, tmp_path / "back")
    before = {n: s["param"] for n, s in read_full_state(read_manifest(out), ("param",)).items()}
    after = {n: s["param"] for n, s in read_full_state(read_manifest(done.path),
                                                       ("param",)).items()}
    assert set(before) == set(after)
    for n in before:  # the padded rows are zero in both
        torch.testing.assert_close(after[n], before[n], rtol=0, atol=0, msg=n)
    assert read_manifest(done.path).data["model"] == read_manifest(out).data["model"]
    torch.testing.assert_close(_logits(after, cfg), _logits(before, cfg), rtol=0, atol=0)


def test_bad_inputs_exit_2_with_one_line(llama, tmp_path, capsys):
    out, _ = llama
    path = ckpt_commands.export(out, "dcp", tmp_path / "dcp")
    (tmp_path / "back").mkdir()
    hf = tmp_path / "hf.json"
    hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2,
                              "intermediate_size": 48, "vocab_size": 65,
                              "max_position_embeddings": 16, "tie_word_embeddings": False}))
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / ".metadata").write_bytes(b"cos\nsystem\n(S'echo owned'\ntR.")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    with open(broken / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    cases = [(["ckpt", "import", "--from", "dcp", str(broken), "--output", str(tmp_path / "w")],
              "its tensors do not read"),
             (["ckpt", "import", "--from", "dcp", str(out), "--output", str(tmp_path / "x")],
              "is not a torch Distributed Checkpoint"),
             (["ckpt", "import", "--from", "dcp", str(path), "--output", str(tmp_path / "back")],
              "exists"),
             (["ckpt", "import", "--from", "dcp", str(path), "--output", str(path / "in")],
              "--output"),
             (["ckpt", "import", "--from", "dcp", str(path), "--config", str(hf), "--output",
               str(tmp_path / "y")], "has shape"),
             (["ckpt", "import", "--from", "dcp", str(evil), "--output", str(tmp_path / "z")],
              "is not part of DCP metadata"),
             (["ckpt", "export", "--format", "dcp", str(out), "--output", str(path)], "exists")]
    r = run(hpctrain_cmd(*cases[0][0]))  # one through the installed command line
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and cases[0][1] in r.stderr
    for args, expect in cases:  # the rest in this process: the same exit path, no start-up
        assert main(args) == 2, args
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], (args, lines)
    for name in ("w", "x", "y", "z"):
        assert not (tmp_path / name).exists()
    assert sorted(os.listdir(tmp_path / "back")) == []


def test_missing_tensor_and_foreign_dcp_without_a_record(gpt2, tmp_path):
    out, cfg = gpt2
    state = {n: p.detach().clone() for n, p in GPT(cfg).named_parameters()}
    del state["h.1.mlp.c_fc.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "foreign"), no_dist=True)
    with pytest.raises(CheckpointError, match="no hpctrain_dcp.json"):
        import_dcp(tmp_path / "foreign", tmp_path / "a")
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"model": cfg.shape()}))
    with pytest.raises(CheckpointError, match="lacks h.1.mlp.c_fc.weight"):
        import_dcp(tmp_path / "foreign", tmp_path / "a", config=record)
    assert cfg.tie_embeddings
    state = {n: p.detach().clone() for n, p in GPT(cfg).named_parameters()}
    state["lm_head.weight"] = state["wte.weight"] + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "untied"), no_dist=True)
    with pytest.raises(CheckpointError, match="lm_head.weight differs from wte.weight"):
        import_dcp(tmp_path / "untied", tmp_path / "a", config=record)
    assert not (tmp_path / "a").exists()


WORKER = """
import json, os, sys, warnings
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig
from tests.titan_llama import TitanLlama
warnings.simplefilter("ignore")
rank, out, arch = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + os.path.join(out, "store"),
                        rank=rank, world_size=2)  # a file, not a port another test may hold
cfg = GPTConfig.from_shape(json.load(open(os.path.join(out, "record.json")))["model"])
torch.manual_seed(0)
model = GPT(cfg) if arch == "gpt2" else TitanLlama(cfg)
for block in (model.h if arch == "gpt2" else model.layers.values()):
    fully_shard(block)
fully_shard(model)
sd = model.state_dict()
assert all(type(v).__name__ == "DTensor" for v in sd.values())
dcp.save(sd, checkpoint_id=os.path.join(out, "fsdp"))
full = {k: v.full_tensor() for k, v in sd.items()}
if rank == 0:
    torch.save(full, os.path.join(out, "full.pt"))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # gloo's threads may abort in interpreter teardown ("terminate called ...")
"""


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gpt2", "llama"])
def test_imports_a_dcp_saved_by_a_two_rank_fsdp2_run(which, request, tmp_path):
    """Two gloo processes shard a plain torch model with FSDP2 and ``dcp.save`` its
    DTensors: our GPT (GPT-2, our names) or the torchtitan-shaped llama3 below."""
    _, cfg = request.getfixturevalue(which)
    (tmp_path / "record.json").write_text(json.dumps({"model": cfg.shape()}))
    (tmp_path / "worker.py").write_text(WORKER)
    env = {"PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(r),
                               str(tmp_path), which], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), outs
    assert len(list((tmp_path / "fsdp").glob("*.distcp"))) == 2
    done = import_dcp(tmp_path / "fsdp", tmp_path / "back", config=tmp_path / "record.json")
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    got = {n: s["param"] for n, s in read_full_state(read_manifest(done.path),
                                                     ("param",)).items()}
    if which == "llama":  # back in torchtitan's names and layout, by the test's own hand
        got = _torchtitan({n: {"param": t} for n, t in got.items()}, "param", cfg)
    assert set(got) <= set(full) and len(got) >= len(full) - 1  # a tied head: one tensor
    for n, t in got.items():
        torch.testing.assert_close(t, full[n], rtol=0, atol=0, msg=n)


def test_a_torchtitan_shaped_model_loads_the_export_and_gives_our_logits(llama, tmp_path):
    out, cfg = llama
    path = ckpt_commands.export(out, "dcp", tmp_path / "dcp")
    titan = TitanLlama(cfg)
    state = titan.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)  # every key must be there
    titan.load_state_dict(state)
    params = {n: s["param"] for n, s in read_full_state(read_manifest(out), ("param",)).items()}
    x = torch.arange(12).reshape(2, 6) % cfg.vocab_size
    with torch.no_grad():
        theirs = titan(x)[:, -1]
    ours = _logits(params, cfg).reshape(theirs.shape[0], -1)[:, :cfg.vocab_size]
    assert theirs.std() > 0.1
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_a_torchtitan_model_saved_under_model_imports_with_a_hf_config(llama, tmp_path):
    """What a torchtitan user has: a DCP of the model (here nested as ``{"model": ...}``)
    and the model's Hugging Face ``config.json``; the import gives that model's logits."""
    _, cfg = llama
    torch.manual_seed(3)
    titan = TitanLlama(cfg)
    with torch.no_grad():
        for p in titan.parameters():
            p.add_(0.05 * torch.randn_like(p))  # the norms too: no weight left at its init
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": titan.state_dict()}, checkpoint_id=str(tmp_path / "titan"),
                 no_dist=True)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg.shape())))
    done = import_dcp(tmp_path / "titan", tmp_path / "back", config=tmp_path / "config.json")
    params = {n: s["param"] for n, s in read_full_state(read_manifest(done.path),
                                                        ("param",)).items()}
    x = torch.arange(12).reshape(2, 6) % cfg.vocab_size
    with torch.no_grad():
        theirs = titan(x)[:, -1]
    ours = _logits(params, GPTConfig.from_shape(read_manifest(done.path).data["model"]))
    ours = ours.reshape(theirs.shape[0], -1)[:, :cfg.vocab_size]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
