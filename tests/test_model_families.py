"""Model families and their parallel plans, in one process: every family's plan names
real parameters whose splits add up, the count its traits give is what it builds,
``parallel/`` names no parameter of any family, and the test-only third family
(``tests/third_family.py``) is a model like the others (its MPI runs at dp, tp and pp:
``test_model_families_mpi.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint.format import CheckpointError
from hpctrain.checkpoint.hf_names import rules
from hpctrain.model.families import ARCHS, family_of
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig
from hpctrain.parallel.pipeline.stage import PipelineStage
from tests.third_family import ARCH as THIRD

PARALLEL = Path(__file__).resolve().parents[1] / "hpctrain" / "parallel"
SHAPES = {"gpt": {"bias": True}, "llama": {"n_kv_head": 2, "tie_embeddings": False},
          THIRD: {"bias": True}}


def _config(arch: str, **extra) -> GPTConfig:
    shape = {"vocab_size": 40, "block_size": 12, "n_layer": 4, "n_head": 4, "n_embd": 32,
             "vocab_multiple": 8}
    return GPTConfig(arch=arch, **{**shape, **SHAPES[arch], **extra})


@pytest.mark.parametrize("arch", list(SHAPES))
def test_the_traits_count_what_the_family_builds(arch):
    cfg = _config(arch)
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params(non_embedding=False)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_every_split_in_the_plan_names_a_parameter_and_its_parts_add_up(arch):
    cfg = _config(arch)
    plan = cfg.family.plan
    params = dict(GPT(cfg).named_parameters())
    for split in plan.block_splits:
        assert f"{plan.blocks}.0.{split.path}.weight" in params, split.path
    split_names = [n for n in params if plan.shard_spec(n, cfg) is not None]
    # the embedding, an untied head, and per block each split layer's weight (and a
    # column layer's bias)
    columns = sum(s.style == "column" for s in plan.block_splits)
    per_block = len(plan.block_splits) + columns * cfg.bias
    assert len(split_names) == 2 - cfg.tie_embeddings + cfg.n_layer * per_block
    for name in split_names:
        spec = plan.shard_spec(name, cfg)
        assert sum(spec.parts) == params[name].shape[spec.dim], name
    assert plan.shard_spec(f"{plan.final_norm}.weight", cfg) is None


MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_shared": 1, "moe_shared_gate": True}
"""Every family also built as a mixture of experts (router, experts, shared ones)."""


def _parameter_words() -> set[str]:
    """Every part of every built family's parameter names that names a module, dense and
    as a mixture of experts. Left out: ``experts``, the concept ``parallel/experts/`` is
    named for (the plan's ``experts`` path names the module), and ``shared``, an everyday
    word there (shared memory; the shared experts' own modules are still checked)."""
    words = set()
    for arch in SHAPES:
        for extra in ({}, MOE):
            cfg = _config(arch, tie_embeddings=False, **extra)
            for name, _ in GPT(cfg).named_parameters():
                words |= {w for w in name.split(".") if not w.isdigit() and len(w) > 1}
    return words - {"weight", "bias", "experts", "shared"}


def test_parallel_names_no_parameter_of_any_model():
    """``parallel/`` asks the family's plan; a name there ties it to one model."""
    words = _parameter_words()
    assert {"wte", "wpe", "c_attn", "lm_head", "ln_f", "attn", "mlp", "gate_proj", "router",
            "w_in", "w_out", "shared_gate"} <= words
    found = []
    for path in sorted(PARALLEL.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            hits = sorted(w for w in words if re.search(rf"\b{re.escape(w)}\b", line))
            if hits:
                found.append(f"{path.relative_to(PARALLEL.parent)}:{n}: {hits}")
    assert not found, "parallel/ names model parameters:\n" + "\n".join(found)


def test_a_registered_family_is_a_choice_of_the_config():
    from hpctrain.config import load_config

    assert THIRD in ARCHS and THIRD in ", ".join(ARCHS)
    cfg = load_config("default", [f"--model.arch={THIRD}"])
    assert cfg.model.to_gpt(40).family is family_of(THIRD)
    with pytest.raises(ValueError, match="is not one of gpt, llama, gpt2-geglu"):
        family_of("mamba")


def test_a_family_without_a_hugging_face_layout_is_refused_by_name():
    with pytest.raises(CheckpointError, match="'gpt2-geglu' has no Hugging Face layout"):
        rules(_config(THIRD).shape())


def test_the_third_family_inits_its_residual_outputs_scaled():
    cfg = _config(THIRD, n_layer=8, n_embd=64)
    params = dict(GPT(cfg).named_parameters())
    scaled = 0.02 / (2 * cfg.n_layer) ** 0.5
    assert params["h.0.mlp.down_proj.weight"].std().item() == pytest.approx(scaled, rel=0.1)
    assert params["h.0.mlp.up_proj.weight"].std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("tie", [True, False])
def test_the_third_family_cut_into_stages_gives_the_model_loss(tie):
    cfg = _config(THIRD, tie_embeddings=tie)
    torch.manual_seed(0)
    ref = GPT(cfg)
    x, y = torch.randint(0, 40, (3, 12)), torch.randint(0, 40, (3, 12))
    stages = []
    for s in range(2):
        torch.manual_seed(0)
        stages.append(PipelineStage(GPT(cfg), s, 2))
    h = stages[0].chunk_forward(0, x)
    loss = stages[1].chunk_forward(0, h, y)
    torch.testing.assert_close(loss, ref(x, y), atol=1e-6, rtol=0)
    named = {n for st in stages for n, _ in st.named_parameters()}
    assert named == {n for n, _ in ref.named_parameters()}
