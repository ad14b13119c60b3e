"""The backward split into B (input gradient) and W (weight gradients), in one process,
against the fused backward of the same stage."""

import pytest
import torch

from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.pipeline.split_backward import backward_input
from hpctrain.parallel.pipeline.stage import PipelineStage


def _stage(arch, recompute, stage, dtype=torch.float32):
    extra = dict(n_kv_head=1, ffn_hidden=48, tie_embeddings=False) if arch == "llama" else {}
    cfg = GPTConfig(vocab_size=40, block_size=12, n_layer=4, n_head=2, n_embd=16, arch=arch,
                    recompute=recompute, **extra)
    torch.manual_seed(0)
    st = PipelineStage(GPT(cfg), stage, 2).to(dtype)
    st.sync_head_dtype()
    return st


def _weights(st):
    return list(st.parameters()) + ([st.head_copy] if st.head_copy is not None else [])


def _run(st, x, y, split):
    """One micro-batch's forward and backward; returns the input's and every weight's
    gradient, and the weights whose post-accumulate hook fired during B and during W."""
    for w in _weights(st):
        w.grad = None
    fired, phase = {"B": [], "W": []}, ["B"]
    hooks = [w.register_post_accumulate_grad_hook(lambda t: fired[phase[0]].append(t))
             for w in _weights(st)]
    x = x.clone().requires_grad_(True) if x.is_floating_point() else x
    out = st.chunk_forward(0, x, y)
    grad = None if y is not None else torch.ones_like(out)
    if split:
        kept = backward_input(out, grad, x, _weights(st))
        phase[0] = "W"
        kept.run()
    else:
        torch.autograd.backward(out, grad)
    for h in hooks:
        h.remove()
    return x.grad, [w.grad.clone() for w in _weights(st)], fired


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["none", "selective", "block"])
@pytest.mark.parametrize("stage", [0, 1])
def test_b_then_w_gives_the_fused_backwards_gradients(arch, recompute, stage):
    """Stage 0 (embedding, no input gradient) and stage 1 (head and loss; GPT's head is
    the tied embedding's copy), with and without recomputed blocks (wholly or selectively)."""
    st = _stage(arch, recompute, stage)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 40, (2, 12), generator=gen) if stage == 0 else \
        torch.randn(2, 12, 16, generator=gen)
    y = torch.randint(0, 40, (2, 12), generator=gen) if stage == 1 else None
    dx, grads, _ = _run(st, x, y, split=False)
    dx_split, grads_split, fired = _run(st, x, y, split=True)
    if stage == 1:
        torch.testing.assert_close(dx_split, dx, atol=1e-6, rtol=0)
    for (name, _), g, g_split in zip(st.named_parameters(), grads, grads_split):
        torch.testing.assert_close(g_split, g, atol=1e-6, rtol=0, msg=name)
    if st.head_copy is not None:
        torch.testing.assert_close(grads_split[-1], grads[-1], atol=1e-6, rtol=0)
    # The engines' hooks: none during B, each weight's exactly once during W.
    assert fired["B"] == []
    assert sorted(map(id, fired["W"])) == sorted(map(id, _weights(st)))


def test_b_computes_no_weight_gradient_and_w_accumulates():
    """After B the weights have no gradient; W adds to what .grad holds (gradient
    accumulation over micro-batches, bucket views kept)."""
    st = _stage("gpt", "none", 1)
    x = torch.randn(2, 12, 16, requires_grad=True)
    y = torch.randint(0, 40, (2, 12))
    before = {id(w): torch.ones_like(w) for w in _weights(st)}
    views = {}
    for w in _weights(st):
        w.grad = before[id(w)].clone()
        views[id(w)] = w.grad
    kept = backward_input(st.chunk_forward(0, x, y), None, x, _weights(st))
    assert x.grad is not None
    for w in _weights(st):
        assert torch.equal(w.grad, before[id(w)])
    kept.run()
    changed = [w for w in _weights(st) if not torch.equal(w.grad, before[id(w)])]
    assert len(changed) == len(_weights(st))
    assert all(w.grad is views[id(w)] for w in _weights(st))  # accumulated in place


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_w_never_walks_the_input_path_again(arch):
    """Every weight is in a group whose W starts where its branch leaves the path to the
    input: the gradient of no block's output is computed again in W (a W that fell
    back to a whole backward would compute each once more, and be correct, and slow)."""
    st = _stage(arch, "none", 1)
    x = torch.randn(2, 12, 16, requires_grad=True)
    y = torch.randint(0, 40, (2, 12))
    seen, phase = {"B": 0, "W": 0}, ["B"]

    def count(_grad):
        seen[phase[0]] += 1

    def watch(_module, _inputs, out):
        out.register_hook(count)  # returns None: the output stays as it is

    handles = [block.register_forward_hook(watch) for block in st.h.values()]
    kept = backward_input(st.chunk_forward(0, x, y), None, x, _weights(st))
    for h in handles:
        h.remove()
    phase[0] = "W"
    kept.run()
    assert seen == {"B": len(st.h), "W": 0}


def test_bf16_split_matches_the_fused_bf16_backward():
    st = _stage("llama", "block", 1, torch.bfloat16)
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = torch.randint(0, 40, (2, 12))
    dx, grads, _ = _run(st, x, y, split=False)
    dx_split, grads_split, _ = _run(st, x, y, split=True)
    torch.testing.assert_close(dx_split, dx)
    for g, g_split in zip(grads, grads_split):
        torch.testing.assert_close(g_split, g)


def test_a_weight_used_twice_in_one_chunk_is_counted_once_per_use():
    """Two branch roots reach the same weight (one group of two roots): W's pre-hooks
    pin each root's output gradient to what B kept, so the path between them adds
    nothing twice."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)

    def grads(split):
        lin.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = lin(torch.tanh(lin(xx))).square().sum()
        if split:
            backward_input(out, None, xx, list(lin.parameters())).run()
        else:
            out.backward()
        return xx.grad, [p.grad for p in lin.parameters()]

    (dx, ref), (dx_split, got) = grads(False), grads(True)
    torch.testing.assert_close(dx_split, dx)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("tie", [True, False])
def test_the_chunked_loss_splits_like_the_whole_one(tie):
    """``--model.loss_chunk``: the head and loss run in chunks under their own autograd
    function; B and W still give the fused backward's gradients."""
    cfg = GPTConfig(vocab_size=40, block_size=12, n_layer=4, n_head=2, n_embd=16,
                    loss_chunk=8, tie_embeddings=tie)
    torch.manual_seed(0)
    st = PipelineStage(GPT(cfg), 1, 2)
    x, y = torch.randn(2, 12, 16), torch.randint(0, 40, (2, 12))
    dx, grads, _ = _run(st, x, y, split=False)
    dx_split, grads_split, fired = _run(st, x, y, split=True)
    torch.testing.assert_close(dx_split, dx)
    for g, g_split in zip(grads, grads_split):
        torch.testing.assert_close(g_split, g)
    assert fired["B"] == []
