"""Activation recomputation in one process: selective, every N-th block, whole blocks.
Each computes what the model without recomputation computes (the same dropout masks
included) and keeps less; the MPI layouts are in ``test_recompute_mpi.py``."""

import dataclasses

import pytest
import torch

from hpctrain.model.common.recompute import KeptActivations
from hpctrain.model.gpt import GPT, GPTConfig

MODES = {"selective": {"recompute": "selective"},
         "every-2": {"recompute_every": 2},
         "selective+every-2": {"recompute": "selective", "recompute_every": 2},
         "block": {"recompute": "block"}}


def model(arch="gpt", n_layer=4, block_size=32, **kw):
    torch.manual_seed(0)
    extra = {"n_kv_head": 2} if arch == "llama" else {}
    return GPT(GPTConfig(vocab_size=64, block_size=block_size, n_layer=n_layer, n_head=4,
                         n_embd=32, arch=arch, **extra, **kw))


def loss_and_grads(m, x, y, seed=5):
    torch.manual_seed(seed)  # the dropout masks' draws
    m.zero_grad()
    loss = m(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def batch(block_size=32):
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 64, (2, 2, block_size), generator=g).unbind(0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_recomputation_matches_the_model_without_it(arch, mode, dropout):
    """The loss bit for bit (with dropout: the recomputed forward draws the masks the
    first one did), the gradients to fp32 round-off."""
    x, y = batch()
    want_loss, want = loss_and_grads(model(arch, dropout=dropout), x, y)
    loss, got = loss_and_grads(model(arch, dropout=dropout, **MODES[mode]), x, y)
    torch.testing.assert_close(loss, want_loss, atol=0, rtol=0)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_every_nth_block_is_the_last_of_each_group_of_n():
    assert [b.recompute for b in model(n_layer=5, recompute_every=2).h] == [
        "none", "block", "none", "block", "none"]
    assert [b.recompute for b in model(n_layer=3, recompute="selective",
                                       recompute_every=3).h] == [
        "selective", "selective", "block"]
    assert [b.recompute for b in model(n_layer=2, recompute_every=1).h] == ["block"] * 2


def blocks_kept_bytes(m, rows=2) -> int:
    """What the blocks' forward leaves for backward (the input and parameters left out,
    the last block's output in: the next layer's input), on a random (rows, T, C)."""
    x = torch.randn(rows, m.cfg.block_size, m.cfg.n_embd, requires_grad=True)
    with KeptActivations() as kept:
        h = x
        for block in m.h:
            h = block(h)
    tables = [t for b in m.h if b.attn.rotary for pair in b.attn.rotary._tables.values()
              for t in pair]  # rotary's cos and sin: constants, made on the first call
    return kept.bytes(exclude=[*m.parameters(), x, *tables])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_kept_activations_are_what_the_formulas_say(arch):
    """Measured on real blocks: none keeps ``activation_bytes_per_layer`` (the fp32
    count; gpt's 34 of Korthikanti's words count its 2 dropout masks, not kept without
    dropout: 32), selective ``selective_bytes_per_layer`` (the matmul and attention
    outputs), whole blocks their inputs, every-2 half of each; each within 3% (what the
    formulas leave out: norm and softmax statistics)."""
    from hpctrain.scaling.activations import (activation_bytes_per_layer, layer_input_bytes,
                                              selective_bytes_per_layer)
    from hpctrain.scaling.models import ModelShape
    m = model(arch, block_size=128)
    shape = ModelShape(**{k: v for k, v in m.cfg.shape().items()
                          if k in ModelShape.__dataclass_fields__})
    full = activation_bytes_per_layer(shape, 2, "fp32", flash_attention=True)
    if arch == "gpt":
        full *= 32 / 34
    want = {"none": full, "selective": selective_bytes_per_layer(shape, 2, "fp32"),
            "block": layer_input_bytes(shape, 2, "fp32")}
    want["every-2"] = (want["none"] + want["block"]) / 2
    for mode, per_layer in want.items():
        got = blocks_kept_bytes(model(arch, block_size=128, **MODES.get(mode, {})))
        assert got == pytest.approx(4 * per_layer, rel=0.03), mode
    assert want["selective"] < (0.7 if arch == "gpt" else 0.55) * want["none"]


def test_evaluation_under_selective_recomputation_keeps_nothing_and_agrees():
    x, _ = batch()
    plain, selective = model(), model(recompute="selective")
    plain.eval(), selective.eval()
    with torch.no_grad():
        torch.testing.assert_close(selective(x), plain(x), atol=0, rtol=0)


def test_attention_that_draws_dropout_is_recomputed_not_kept(monkeypatch):
    """A kept fused attention would not draw its dropout mask again in the recomputed
    forward, and every later mask of the block would differ. This CPU runs attention
    with dropout unfused (nothing fused to keep), so the equality tests above cannot see
    that choice: it is checked here, in the blocks and in the policy."""
    from torch.utils.checkpoint import CheckpointPolicy

    from hpctrain.model.common import layers, recompute
    asked, real = [], layers.selective_checkpoint
    monkeypatch.setattr(layers, "selective_checkpoint", lambda fn, x, keep_attention: (
        asked.append(keep_attention), real(fn, x, keep_attention))[1])
    x, y = batch()
    for dropout in (0.0, 0.2):
        model(dropout=dropout, recompute="selective")(x, y)
    assert asked == [True] * 4 + [False] * 4
    assert recompute.FUSED_ATTENTION
    for op in recompute.FUSED_ATTENTION:
        assert recompute._policy(True, None, op) == CheckpointPolicy.MUST_SAVE
        assert recompute._policy(False, None, op) == CheckpointPolicy.PREFER_RECOMPUTE


def test_the_performance_model_counts_selective_and_every_nth_block():
    """Memory: none > selective > every-2 (of none) > block; compute: selective adds no
    FLOPs, every-2 a third of half the layers' forward, block a third of all."""
    from hpctrain.errors import UserError
    from hpctrain.scaling import perfmodel as pm
    from hpctrain.scaling.models import preset_shape
    shape = preset_shape("llama3-8b")
    arr = pm.Arrangement(ranks=8, global_batch=8, dtype="bf16")
    mem = {mode: pm.activation_bytes(shape, dataclasses.replace(arr, **opts), 32, True)
           for mode, opts in MODES.items()}
    mem["none"] = pm.activation_bytes(shape, arr, 32, True)
    assert mem["none"] > mem["selective"] > mem["selective+every-2"] > mem["block"]
    assert mem["none"] > mem["every-2"] > mem["block"]
    per_layer = pm.activation_bytes_per_layer(shape, 1, "bf16", True)
    assert pm.selective_bytes_per_layer(shape, 1, "bf16") / per_layer == pytest.approx(
        25 / 51.5)
    assert [pm.recomputed_layers(dataclasses.replace(arr, **MODES[m]), 32)
            for m in ("selective", "every-2", "block")] == [0, 16, 32]
    with pytest.raises(UserError, match="recompute_every"):
        pm.Arrangement(ranks=8, recompute="block", recompute_every=2).check(shape)
