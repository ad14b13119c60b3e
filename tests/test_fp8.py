"""``--train.fp8=true`` in one process (``parallel/fp8.py``): which linear layers become
torchao ``Float8Linear`` (the blocks' attention and MLP projections, never the head, the
embeddings, the router or the routed experts; dimensions not multiples of 16 left in
bf16 and named), the device refusals, the emulated FP8 run on the fake device against
the bf16 run, and checkpoint names that a run without FP8 loads. The parallel layouts
against this single-process run: ``test_fp8_mpi.py``."""

import types

import numpy as np
import pytest
import torch
from mpi4py import MPI

pytest.importorskip("torchao")

from hpctrain.checkpoint.weights import load_weights  # noqa: E402
from hpctrain.comm.world import World  # noqa: E402
from hpctrain.config import ConfigError  # noqa: E402
from hpctrain.model.gpt import GPT  # noqa: E402
from hpctrain.model.shape import GPTConfig  # noqa: E402
from hpctrain.parallel.fp8 import check_fp8_device, convert_linears  # noqa: E402
from hpctrain.train.trainer import Trainer  # noqa: E402
from tests.helpers import LLAMA, cpu_world, tiny_config  # noqa: E402

FP8_LOSS_ATOL = 0.02
"""Emulated FP8 against bf16, the same model, data and seed, every loss of 20 steps (the
tiny GPT and Llama from 4.4 to about 3.5). Measured: at most 3e-3; FP8's e4m3 keeps 3
mantissa bits against bf16's 7, so the runs drift apart a little each step. A scaling
error (an operand not divided by its scale) moves the first loss by far more."""


def _fake_trainer(cfg):
    return Trainer(cfg, World.create(MPI.COMM_SELF, device="fake"), verbose=False)


def _gpt(**kw):
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, **kw))


def _float8_paths(model):
    return sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_the_blocks_projections_become_fp8_and_keep_their_parameters(arch):
    kw = {"arch": "llama", "n_kv_head": 1, "ffn_hidden": 48, "tie_embeddings": False} \
        if arch == "llama" else {}
    gpt = _gpt(**kw)
    before = dict(gpt.named_parameters())
    done = convert_linears(gpt, emulate=True, seq=16)
    want = sorted(f"h.{i}.{p}" for i in range(2)
                  for p in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    assert _float8_paths(gpt) == want == sorted(done.converted)
    assert done.skipped == ()
    assert type(gpt.lm_head) is torch.nn.Linear and type(gpt.wte) is torch.nn.Embedding
    after = dict(gpt.named_parameters())
    assert list(after) == list(before)  # checkpoint names unchanged
    assert all(after[n] is before[n] for n in before)  # the same Parameter objects
    assert done.describe().startswith("fp8: 8 linear layer(s) in FP8 (emulated on the "
                                      "fake device, dynamic tensorwise scaling, torchao")
    assert "head and embeddings in bf16" in done.describe()


def test_layers_whose_dimensions_do_not_fit_stay_bf16_and_are_named():
    gpt = _gpt(arch="llama", n_kv_head=1, ffn_hidden=40, tie_embeddings=False)
    done = convert_linears(gpt, emulate=True, seq=16)
    assert done.skipped == ("h.0.mlp.c_proj", "h.1.mlp.c_proj")  # 40 -> 32
    assert len(done.converted) == 6 and "h.0.mlp.c_fc" in done.converted  # 32 -> 80
    assert "2 left in bf16, a dimension not a multiple of 16: h.0.mlp.c_proj, " \
           "h.1.mlp.c_proj" in done.describe()


def test_moe_blocks_convert_the_shared_experts_but_not_the_router_or_routed_experts():
    gpt = _gpt(moe_experts=16, moe_shared=1, moe_shared_gate=True)  # a router that fits
    done = convert_linears(gpt, emulate=True, seq=16)
    assert done.skipped == ()  # the gate's single output is no candidate
    paths = _float8_paths(gpt)
    assert "h.0.mlp.shared.c_fc" in paths and "h.0.mlp.shared.c_proj" in paths
    assert "h.0.attn.c_attn" in paths
    assert not any(p.endswith(("router", "shared_gate")) or ".experts" in p for p in paths)


def test_a_run_in_emulated_fp8_stays_near_the_bf16_run(dataset_path, tmp_path):
    for arch, over in (("gpt", {}), ("llama", LLAMA)):
        losses = {}
        for fp8 in (False, True):
            cfg = tiny_config(dataset_path, tmp_path / f"{arch}{fp8}", **over, **{
                "train.dtype": "bf16", "train.fp8": fp8, "train.max_iters": 20})
            trainer = _fake_trainer(cfg)
            assert (trainer.par.fp8 is not None) == fp8
            losses[fp8] = trainer.fit().losses
        assert losses[True] != losses[False], arch  # FP8 did round something
        np.testing.assert_allclose(losses[True], losses[False], atol=FP8_LOSS_ATOL, rtol=0)


@pytest.mark.slow
def test_compiled_fp8_blocks_train_like_eager_ones(dataset_path, tmp_path):
    """torch.compile of each block traces torchao's casts and scaled matrix multiplies
    (inductor on the CPU: 25-50 s cold). Measured: losses within 4e-4 of the eager FP8 run,
    the compiler fusing the casts and rounding a little differently."""
    losses = {}
    for compile_ in (False, True):
        cfg = tiny_config(dataset_path, tmp_path / str(compile_), **{
            "train.dtype": "bf16", "train.fp8": True, "train.max_iters": 3,
            "train.compile": compile_})
        trainer = _fake_trainer(cfg)
        assert len(_float8_paths(trainer.model)) == 8
        losses[compile_] = trainer.fit().losses
    np.testing.assert_allclose(losses[True], losses[False], atol=5e-3, rtol=0)


def test_an_fp8_checkpoint_resumes_in_a_run_without_fp8(dataset_path, tmp_path):
    over = {"train.dtype": "bf16", "train.max_iters": 3, "train.save_checkpoint": True,
            "parallel.zero": 3}
    _fake_trainer(tiny_config(dataset_path, tmp_path / "a", **over,
                              **{"train.fp8": True})).fit()
    step = tmp_path / "a" / "checkpoints" / "step_000003"
    saved, _, _ = load_weights(step)
    plain = _fake_trainer(tiny_config(dataset_path, tmp_path / "b", **{
        **over, "train.max_iters": 4, "train.resume": str(step)}))
    assert plain.start.step == 3
    master = plain.engine.consolidated_state()
    assert set(master) == set(saved) == {n for n, _ in plain.model.named_parameters()}
    for name, state in master.items():
        torch.testing.assert_close(state["param"], saved[name].float(), atol=0, rtol=0)
    plain.close()


def test_fp8_needs_bf16_and_refuses_the_cpu_naming_the_fake_device(dataset_path, tmp_path):
    with pytest.raises(ConfigError, match="--train.dtype=bf16"):
        tiny_config(dataset_path, tmp_path, **{"train.fp8": True})
    cfg = tiny_config(dataset_path, tmp_path, **{"train.fp8": True, "train.dtype": "bf16"})
    with pytest.raises(ConfigError, match="--train.device=fake"):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)


def _gpu(kind="cuda"):
    return types.SimpleNamespace(kind=kind, index=0)


@pytest.mark.parametrize("capability, ok", [((8, 0), False), ((8, 6), False),
                                            ((8, 9), True), ((9, 0), True), ((10, 0), True)])
def test_nvidia_gpus_need_compute_capability_8_9(monkeypatch, capability, ok):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    if ok:
        assert check_fp8_device(_gpu()) is False  # real FP8, not emulated
    else:
        with pytest.raises(ConfigError, match=r"capability 8\.9 or newer.*this one is "
                                              rf"{capability[0]}\.{capability[1]}"):
            check_fp8_device(_gpu())


@pytest.mark.parametrize("arch, ok", [("gfx90a:sramecc+:xnack-", False),
                                      ("gfx942:sramecc+:xnack-", True), ("gfx950", True)])
def test_amd_gpus_need_mi300_class(monkeypatch, arch, ok):
    monkeypatch.setattr(torch.version, "hip", "6.2")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index=None: types.SimpleNamespace(gcnArchName=arch))
    if ok:
        assert check_fp8_device(_gpu()) is False
    else:
        with pytest.raises(ConfigError, match="MI300-class"):
            check_fp8_device(_gpu())


def test_xpu_and_a_missing_torchao_are_refused(monkeypatch):
    """Tensor parallelism is no longer refused: ``test_fp8_tp_mpi.py``."""
    with pytest.raises(ConfigError, match="CUDA and ROCm"):
        check_fp8_device(_gpu("xpu"))
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)
    with pytest.raises(ConfigError, match=r"pip install 'hpctrain\[gpu\]'"):
        convert_linears(_gpt(), emulate=True, seq=16)
