"""A Llama-family run's checkpoints through the checkpoint tools: inspect, reshard, merge,
resume and sample (GPT-2's are in ``test_checkpoint_tools.py``; the Hugging Face export
and import are in the hf leg)."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.checkpoint import ckpt_commands
from hpctrain.checkpoint.sharded import CheckpointError, read_full_state, read_manifest
from hpctrain.checkpoint.single_file import load_single_file
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, hpctrain_cmd, run, tiny_config

LLAMA = {"model.arch": "llama", "model.n_head": 4, "model.n_kv_head": 2,
         "model.ffn_hidden": 48, "model.tie_embeddings": False,
         "parallel.bucket_mb": 0.02, "parallel.first_bucket_mb": 0.005}


@pytest.fixture(scope="module")
def trained(dataset_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama-ckpt")
    cfg = tiny_config(dataset_path, out, **{**LLAMA, "parallel.zero": 2,
                                            "train.ckpt_interval": 10,
                                            "train.save_checkpoint": True,
                                            "train.max_iters": 20})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    result = trainer.fit()
    with trainer.engine.gathered():
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return out, cfg, result, params


def test_the_manifest_records_the_architecture(trained):
    out, _, _, params = trained
    m = read_manifest(out / "checkpoints" / "step_000020")
    record = m.data["model"]
    assert (record["arch"], record["n_kv_head"], record["tie_embeddings"]) == ("llama", 2, False)
    assert GPTConfig.from_shape(record).num_params(non_embedding=False) == \
        sum(p.numel() for p in params.values())
    assert "arch=llama" in ckpt_commands.inspect(out, verify=True)


@pytest.mark.parametrize("world,zero", [(2, 3), (1, 0)])
def test_reshard_and_merge_keep_every_parameter(trained, tmp_path, world, zero):
    out, _, _, params = trained
    new = ckpt_commands.reshard(out, tmp_path / "new", world=world, zero=zero)
    for name, s in read_full_state(read_manifest(new)).items():
        torch.testing.assert_close(s["param"], params[name], atol=0, rtol=0)
    merged = load_single_file(ckpt_commands.merge(new, tmp_path / "m.h5"))
    assert set(merged.model) == set(params) and "lm_head.weight" in merged.model
    for name, p in params.items():
        np.testing.assert_array_equal(merged.model[name], p.numpy())


def test_a_llama_checkpoint_resumes_and_refuses_a_gpt_run(dataset_path, trained, tmp_path):
    out, cfg, full, _ = trained
    step10 = str(out / "checkpoints" / "step_000010")
    resumed = Trainer(tiny_config(dataset_path, tmp_path / "again", **{
        **LLAMA, "parallel.zero": 1, "train.max_iters": 20, "train.resume": step10}),
        cpu_world(MPI.COMM_SELF), verbose=False).fit()
    np.testing.assert_allclose(resumed.losses, full.losses[10:], atol=1e-5, rtol=0)
    with pytest.raises(CheckpointError, match=r"arch=llama \(yours gpt\)"):
        Trainer(tiny_config(dataset_path, tmp_path / "gpt", **{"train.resume": step10}),
                cpu_world(MPI.COMM_SELF), verbose=False)


@pytest.mark.slow  # a subprocess
def test_sample_from_a_llama_checkpoint(trained):
    out, _, _, params = trained
    p = run(hpctrain_cmd("sample", "--checkpoint", str(out / "checkpoints" / "step_000020"),
                         "--prompt", "def ", "--tokens", "20"))
    assert p.returncode == 0 and p.stdout.startswith("def "), p.stderr
    model = GPT(GPTConfig.from_shape(read_manifest(out / "checkpoints" / "step_000020")
                                     .data["model"]))
    model.load_parameters(params)  # the untied head loads under its own name
    assert not torch.equal(model.lm_head.weight, model.wte.weight)
