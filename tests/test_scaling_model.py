"""The performance model's pure parts: shapes, collective costs, bubble, memory, predict,
and the planner built on them (no MPI, no runs)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hpctrain.errors import UserError
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import SHAPE_KEYS
from hpctrain.parallel.memory import zero_formula
from hpctrain.scaling import comm_cost
from hpctrain.scaling import perfmodel as pm
from hpctrain.scaling.models import ModelShape, preset_shape
from hpctrain.scaling.planner import plan
from hpctrain.scaling.system_perf import ShapeRate, load_perf

LINK = comm_cost.Link(alpha_s=1e-5, bandwidth=1e10)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dims", [(2, 2, 32, 16, 50), (3, 4, 64, 32, 97)])
def test_shape_counts_match_the_real_model(dims, bias):
    L, H, C, T, V = dims
    shape = ModelShape(L, H, C, T, V, bias=bias)
    gpt = GPT(shape.gpt)
    assert gpt.cfg.bias is bias and gpt.cfg.dropout == 0.0
    every = {n: p.numel() for n, p in gpt.named_parameters()}
    assert shape.params == sum(every.values())
    assert shape.params_non_embedding == shape.params - every["wpe.weight"]
    assert shape.layer_params == sum(v for n, v in every.items() if n.startswith("h.0."))
    assert L * shape.layer_params + shape.embedding_params == shape.params_non_embedding
    assert shape.flops_per_token == pytest.approx(gpt.flops_per_token())
    assert L * shape.layer_flops_per_token + shape.head_flops_per_token == \
        pytest.approx(shape.flops_per_token)
    assert shape.stage_params(1) == shape.params


@pytest.mark.parametrize("tied", [True, False])
def test_llama_shape_counts_match_the_real_model(tied):
    shape = ModelShape(3, 4, 64, 32, 97, arch="llama", n_kv_head=2, tie_embeddings=tied,
                       vocab_multiple=64)
    gpt = GPT(shape.gpt)
    every = {n: p.numel() for n, p in gpt.named_parameters()}
    assert shape.params == sum(every.values())
    assert shape.layer_params == sum(v for n, v in every.items() if n.startswith("h.0."))
    assert 3 * shape.layer_params + shape.embedding_params == shape.params_non_embedding
    assert shape.flops_per_token == pytest.approx(gpt.flops_per_token())
    padding = (128 - 97) * 64  # computed (step time), not credited (MFU)
    assert 3 * shape.layer_flops_per_token + shape.head_flops_per_token == \
        pytest.approx(shape.flops_per_token + 6 * padding)


def test_llama3_8b_preset_has_the_published_parameter_count():
    shape = preset_shape("llama3-8b")
    assert shape.params == pytest.approx(8.03e9, rel=2e-3)  # Meta: 8.03B
    assert (shape.n_kv_head, shape.ffn_hidden, shape.tie_embeddings) == (8, 14336, False)


def test_a_shape_is_a_gpt_config_with_a_name():
    """ModelShape lists GPTConfig's shape fields, so that none is left out of the counts."""
    names = {f.name for f in dataclasses.fields(ModelShape)} - {"name"}
    assert names == set(SHAPE_KEYS)
    shape = preset_shape("gpt2", bias=True)
    assert shape.gpt.shape() == {k: getattr(shape, k) for k in SHAPE_KEYS}
    assert shape.bias and shape.key == preset_shape("gpt2").key
    assert shape.params > preset_shape("gpt2").params
    padded = preset_shape("gpt2", vocab_multiple=64)  # 50257 -> 50304 embedding rows
    assert padded.params - preset_shape("gpt2").params == 47 * 768
    assert padded.flops_per_token == preset_shape("gpt2").flops_per_token


def test_shape_rejects_bad_dimensions():
    with pytest.raises(UserError, match="multiple of n_head"):
        ModelShape(2, 3, 32, 16, 50)
    with pytest.raises(UserError, match="unknown model"):
        preset_shape("gpt5")


def test_ring_costs_are_the_textbook_formulas():
    n = 8e6
    assert comm_cost.ring_allreduce(4, n, LINK) == pytest.approx(6 * 1e-5 + 1.5 * n / 1e10)
    assert comm_cost.reduce_scatter(4, n, LINK) == pytest.approx(3 * 1e-5 + 0.75 * n / 1e10)
    assert comm_cost.allgather(4, n, LINK) == comm_cost.reduce_scatter(4, n, LINK)
    assert comm_cost.p2p(n, LINK) == pytest.approx(1e-5 + n / 1e10)
    assert comm_cost.ring_allreduce(1, n, LINK) == 0.0


def test_large_groups_use_the_log_latency_algorithm():
    small = 1e4  # latency-bound: 2 log2(p) alpha beats 2 (p - 1) alpha
    cost = comm_cost.FORMULAS["allreduce"](1024, small, LINK)
    assert cost == pytest.approx(comm_cost.halving_doubling("allreduce", 1024, small, LINK))
    assert cost < comm_cost.ring_allreduce(1024, small, LINK) / 50


def test_group_link_inside_a_node_and_shared_nics():
    intra, inter = comm_cost.Link(1e-5, 1e11), comm_cost.Link(2e-5, 4e10)
    assert comm_cost.group_link(intra, inter, group_size=4, members_per_node=4,
                           ranks_per_node=4) is intra
    one_ring = comm_cost.group_link(intra, inter, group_size=8, members_per_node=4,
                                    ranks_per_node=4)
    assert one_ring.bandwidth == 4e10 and one_ring.alpha_s == 2e-5
    # pp=4: each data-parallel group has one member per node; 4 groups share the NICs.
    shared = comm_cost.group_link(intra, inter, group_size=8, members_per_node=1, ranks_per_node=4)
    assert shared.bandwidth == pytest.approx(1e10)


@pytest.mark.parametrize("p,m,sched,v,want", [(1, 8, "1f1b", 1, 0.0), (4, 8, "1f1b", 1, 3 / 11),
                                              (4, 8, "gpipe", 1, 3 / 11),
                                              (4, 8, "interleaved", 2, 3 / 19),
                                              (4, 8, "zb-h1", 1, 3 / 27),
                                              (4, 2, "zb-h1", 1, 5 / 11)])
def test_bubble_fraction(p, m, sched, v, want):
    assert pm.bubble_fraction(p, m, sched, v) == pytest.approx(want)


def test_activation_memory_korthikanti():
    shape = ModelShape(1, 4, 64, 128, 10)
    flash = pm.activation_bytes_per_layer(shape, 2, "bf16", flash_attention=True)
    full = pm.activation_bytes_per_layer(shape, 2, "bf16", flash_attention=False)
    assert flash == 128 * 2 * 64 * 34
    assert full == 128 * 2 * 64 * (34 + 5 * 4 * 128 / 64)
    assert pm.activation_bytes_per_layer(shape, 2, "fp32", True) == 2 * flash
    assert pm.micro_batches_in_flight(4, 8, "1f1b") == 4
    assert pm.micro_batches_in_flight(4, 8, "gpipe") == 8
    assert pm.micro_batches_in_flight(4, 8, "zb-h1") == 7


def _saved_activation_bytes(block, x) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward of ``block``,
    each storage once, parameters left out."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    return sum(n for ptr, n in saved.items() if ptr not in params)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("kv", [2, 8])
def test_llama_activation_bytes_are_what_a_real_block_keeps(dtype, kv):
    """Counted tensor by tensor: within 2% of the saved tensors of a real Llama block
    (with grouped-query attention and without), CPU flash attention."""
    import torch

    from hpctrain.model.common.layers import Block

    shape = ModelShape(1, 8, 128, 64, 50, arch="llama", n_kv_head=kv)
    dt = torch.float32 if dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    block = Block(shape.gpt).to(dt)
    saved = _saved_activation_bytes(block, torch.randn(2, 64, 128, dtype=dt,
                                                       requires_grad=True))
    predicted = pm.activation_bytes_per_layer(shape, 2, dtype, flash_attention=True)
    assert predicted == pytest.approx(saved, rel=0.02)
    assert predicted < saved  # what is left out is small, never negative
    h, kv_w, big = 128, kv * 16, shape.ffn_hidden
    word = 4 if dtype == "fp32" else 2
    assert predicted == 64 * 2 * (8 * h + word * (7 * h + 3 * kv_w + 4 * big))
    without = pm.activation_bytes_per_layer(shape, 2, dtype, flash_attention=False)
    assert without - predicted == word * 8 * 64 * 64 * 2  # the softmax output, a s^2 b


def test_llama_keeps_more_per_token_than_gpt2s_34_words():
    shape = preset_shape("llama3-8b")
    per_h = pm.llama_bytes_per_token(shape, "bf16") / shape.n_embd
    assert per_h == pytest.approx(51.5)  # fp32 norms; Korthikanti's count would say 41


@pytest.mark.parametrize("shape", [preset_shape("gpt2"), ModelShape(4, 8, 512, 1024, 32000,
                                                                   arch="llama", n_kv_head=2)])
def test_recomputation_keeps_layer_inputs_and_one_layer(shape):
    sys_ = dataclasses.replace(load_perf("polaris"), overlap=0.0,
                               shapes={shape.key: {"bf16": ShapeRate(1e12, 0.0)}})
    arr = pm.Arrangement(ranks=8, pp=2, micro_batches=4, global_batch=16, dtype="bf16")
    layers, held, rows = shape.n_layer // 2, 2, 2  # 1F1B: stage 0 holds p micro-batches
    arr = dataclasses.replace(arr, global_batch=32)  # 4 x 4 micro-batches of 2 rows
    plain = pm.predict(sys_, shape, arr)
    again = pm.predict(sys_, shape, dataclasses.replace(arr, recompute="block"))
    full = pm.activation_bytes_per_layer(shape, rows, "bf16", sys_.flash_attention)
    assert plain.memory_terms["activations"] == pytest.approx(held * layers * full)
    inputs = 1024 * rows * shape.n_embd * 2  # s b h in bf16
    assert again.memory_terms["activations"] == pytest.approx(held * layers * inputs + full)
    # One more forward of the blocks (2 of their 6 FLOPs per weight and token), for each
    # of the 4 micro-batches; the head is not recomputed, MFU counts the model's FLOPs.
    tokens = 4 * rows * 1024
    extra = tokens * layers * shape.layer_flops_per_token / 3 / 1e12
    assert again.compute_s - plain.compute_s == pytest.approx(extra)
    assert again.mfu < plain.mfu
    assert again.flops_per_s_per_rank * again.step_s == \
        pytest.approx(plain.flops_per_s_per_rank * plain.step_s)


def test_a_chunked_head_holds_one_chunk_of_logits_and_computes_them_twice():
    shape = ModelShape(2, 8, 512, 2048, 32000, arch="llama")
    sys_ = dataclasses.replace(load_perf("polaris"),
                               shapes={shape.key: {"bf16": ShapeRate(1e12, 0.0)}})
    arr = pm.Arrangement(ranks=1, global_batch=2, dtype="bf16", loss_chunk=-1)  # 2 x 2048
    plain = pm.predict(sys_, shape, arr)
    assert plain.memory_terms["logits"] == 2 * 4 * 4096 * 32000
    auto = pm.predict(sys_, shape, dataclasses.replace(arr, loss_chunk=0))  # > 256 MiB
    assert auto.memory_terms["logits"] == 2 * 4 * (2**28 // (4 * 32000)) * 32000 + 4 * 4096
    small = pm.predict(sys_, shape, dataclasses.replace(arr, loss_chunk=0, global_batch=1))
    assert small.memory_terms["logits"] == 2 * 4 * 2048 * 32000  # 250 MiB: all at once
    chunked = pm.predict(sys_, shape, dataclasses.replace(arr, loss_chunk=1024))
    assert chunked.memory_terms["logits"] == 2 * 4 * 1024 * 32000 + 4 * 4096
    whole = pm.predict(sys_, shape, dataclasses.replace(arr, loss_chunk=10_000))
    assert whole.memory_terms["logits"] == 2 * 4 * 4096 * 32000 + 4 * 4096  # one chunk
    extra = 4096 * shape.head_flops_per_token / 3 / 1e12  # the logits again in backward
    assert chunked.compute_s - plain.compute_s == pytest.approx(extra)
    assert chunked.memory_terms["activations"] == plain.memory_terms["activations"]


def _cpu_system(cores=2):
    base = load_perf("local")
    return dataclasses.replace(base, cores_per_node=cores, base_memory=0.0,
                               shapes={}, fits={}, overlap=0.0)


def test_predicted_bubble_matches_the_formula():
    sys_ = load_perf("polaris")
    shape = preset_shape("gpt2")
    pred = pm.predict(sys_, shape, pm.Arrangement(ranks=4, pp=4, micro_batches=8, global_batch=8,
                                                  dtype="bf16"))
    assert pred.bubble_s / pred.compute_s == pytest.approx(3 / 8)
    inter = pm.predict(sys_, shape, pm.Arrangement(ranks=4, pp=4, micro_batches=8, global_batch=8,
                                                   dtype="bf16", schedule="interleaved",
                                                   virtual_stages=3))
    assert inter.bubble_s / inter.compute_s == pytest.approx(3 / 24)
    assert inter.p2p_s == pytest.approx(3 * pred.p2p_s)  # v times the messages
    for q in (pred, inter):  # the step is the sum of its terms, the bubble among them
        assert q.step_s == pytest.approx(q.compute_s + q.bubble_s + q.p2p_s + q.grad_comm_s
                                         + q.gather_s + q.optimizer_s)
        assert q.tokens_per_s == pytest.approx(8 * shape.block_size / q.step_s)


def test_oversubscribed_ranks_share_cores():
    sys_ = _cpu_system(cores=2)
    shape = ModelShape(2, 2, 64, 32, 50)
    one = pm.predict(sys_, shape, pm.Arrangement(ranks=2, global_batch=8))
    four = pm.predict(sys_, shape, pm.Arrangement(ranks=4, global_batch=16))
    assert one.oversubscription == 1.0 and four.oversubscription == 2.0
    assert four.compute_s == pytest.approx(2 * one.compute_s)  # same rows per rank
    assert four.optimizer_s == pytest.approx(2 * one.optimizer_s)


def test_measured_fits_and_shape_rates_win():
    shape = ModelShape(2, 2, 64, 32, 50)
    sys_ = _cpu_system()
    fitted = dataclasses.replace(
        sys_, fits={2: {"allreduce": comm_cost.Fit(1e-3, 0.0)}},
        shapes={shape.key: {"fp32": ShapeRate(1e9, 0.0)}})
    arr = pm.Arrangement(ranks=2, global_batch=4)
    pred = pm.predict(fitted, shape, arr)
    n_buckets = len(pm.bucket_sizes(4.0 * shape.params, arr.bucket_mb))
    assert pred.grad_comm_total_s == pytest.approx(n_buckets * 1e-3)
    tokens = arr.micro_rows * shape.block_size
    assert pred.compute_s == pytest.approx(tokens * shape.flops_per_token / 1e9)


def test_cpu_data_parallelism_uses_the_shared_memory_fit_where_calibrated():
    shape = ModelShape(2, 2, 64, 32, 50)
    fits = {"allreduce": comm_cost.Fit(1e-3, 0.0), "shm_allreduce": comm_cost.Fit(2e-4, 0.0)}
    sys_ = dataclasses.replace(_cpu_system(), fits={2: fits})
    n_buckets = len(pm.bucket_sizes(4.0 * shape.params, 25.0))
    plain = pm.predict(sys_, shape, pm.Arrangement(ranks=2, global_batch=4))
    assert plain.grad_comm_total_s == pytest.approx(n_buckets * 2e-4)
    # ZeRO and bf16 go through the ZeRO engine's MPI collectives, not the shared window.
    bf16 = pm.predict(sys_, shape, pm.Arrangement(ranks=2, global_batch=4, dtype="bf16"))
    assert bf16.grad_comm_total_s == pytest.approx(n_buckets * 1e-3)


def test_zero_stages_memory_and_communication():
    sys_ = dataclasses.replace(load_perf("polaris"), overlap=0.0)  # nothing hidden
    shape = preset_shape("gpt2")
    preds = {z: pm.predict(sys_, shape, pm.Arrangement(ranks=8, zero=z, global_batch=16,
                                                       dtype="bf16")) for z in range(4)}
    for z, p in preds.items():
        assert p.memory_terms["model_state"] == pytest.approx(
            zero_formula(z, "bf16", 8) * shape.params)
    assert preds[0].gather_s == 0.0 and preds[1].gather_s > 0.0
    assert preds[3].gather_s > preds[1].gather_s  # 2 gathers per block and micro-batch
    assert preds[3].optimizer_s < preds[0].optimizer_s  # 1/N of the update
    single = pm.predict(sys_, shape, pm.Arrangement(ranks=1, zero=3, global_batch=2, dtype="bf16"))
    assert single.comm_s == 0.0


def test_predicted_memory_is_what_the_rank_allocates_plus_the_systems_base():
    """``rank_memory_terms`` (what ``make gpu-check`` holds a device's allocator peak
    against) is the prediction without the base, term for term."""
    from hpctrain.scaling.rank_memory import rank_memory_terms

    sys_ = load_perf("polaris")
    shape = preset_shape("llama3.2-1b", block_size=2048)
    for arr in (pm.Arrangement(ranks=1, micro_batches=32, global_batch=256, dtype="bf16"),
                pm.Arrangement(ranks=4, zero=3, global_batch=8, dtype="bf16",
                               recompute="block", loss_chunk=4096)):
        total, terms = pm.predict_memory(sys_, shape, arr)
        allocated = rank_memory_terms(shape, arr, sys_.flash_attention)
        assert terms == {**allocated, "base": sys_.base_memory + sys_.memory_reserve}
        assert total == pytest.approx(sum(allocated.values()) + terms["base"])


@pytest.mark.parametrize("arrangement,match", [
    (pm.Arrangement(ranks=6, pp=4, global_batch=8), "do not split"),
    (pm.Arrangement(ranks=2, global_batch=3), "multiple of 2"),
    (pm.Arrangement(ranks=4, pp=2, zero=3, global_batch=8), "ZeRO stage 0 or 1"),
    (pm.Arrangement(ranks=2, pp=2, schedule="zb", global_batch=2), "schedule"),
])
def test_illegal_layouts_name_the_fix(arrangement, match):
    with pytest.raises(UserError, match=match):
        arrangement.check(preset_shape("gpt2"))


@pytest.mark.parametrize("system", ["polaris", "aurora"])
@pytest.mark.parametrize("nodes", [1, 8, 64, 512])
def test_plan_is_sorted_legal_and_fits(system, nodes):
    p = plan(system=system, nodes=nodes, model="gpt2-xl")
    assert p.fitting
    times = [c.prediction.step_s for c in p.fitting]
    assert times == sorted(times)
    for c in p.fitting:
        arr = c.arrangement
        assert arr.dp * arr.pp * arr.tp == p.ranks and arr.global_batch % (arr.dp * arr.micro_batches) == 0
        assert c.prediction.memory_bytes <= p.system.device_memory
        assert arr.pp == 1 or arr.zero <= 1
        assert math.isfinite(c.prediction.step_s) and c.prediction.step_s > 0


def test_plan_prefers_more_nodes_for_throughput():
    small = plan(system="polaris", nodes=2, model="gpt2-xl").fitting[0].prediction
    big = plan(system="polaris", nodes=16, model="gpt2-xl").fitting[0].prediction
    assert big.tokens_per_s > 4 * small.tokens_per_s


def test_llama3_8b_plans_without_recomputation_on_16_polaris_nodes(capsys):
    """Tensor and sequence parallelism inside a node fit Llama 3 8B at 8K context
    without recomputing blocks or chunking the loss; with both, more arrangements fit."""
    from hpctrain.cli import main

    p = plan(system="polaris", nodes=16, model="llama3-8b")
    assert p.fitting
    assert all(c.arrangement.recompute == "none" and c.arrangement.loss_chunk == 0
               for c in p.fitting)
    assert all(c.arrangement.tp > 1 and c.arrangement.sequence_parallel for c in p.fitting)
    saving = plan(system="polaris", nodes=16, model="llama3-8b", recompute="block",
                  loss_chunk=4096)
    assert len(saving.fitting) > len(p.fitting)
    assert main(["plan", "--system", "polaris", "--nodes", "16", "--model", "llama3-8b",
                 "--top", "1", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel collectives" in out and "tp=" in out


@pytest.mark.parametrize("system", ["polaris", "aurora"])
def test_tensor_parallel_groups_stay_inside_a_node(system):
    p = plan(system=system, nodes=2, model="llama3-8b", seq_len=2048)
    rpn = p.system.ranks_per_node
    tps = {c.arrangement.tp for c in p.fitting}
    assert max(tps) > 1 and all(rpn % tp == 0 for tp in tps)
    assert all(c.arrangement.dp * c.arrangement.pp * c.arrangement.tp == p.ranks for c in p.fitting)


def test_llama3_70b_plans_on_64_polaris_nodes():
    shape = preset_shape("llama3-70b")
    assert shape.params == pytest.approx(70.55e9, rel=1e-3)  # Meta's 70.6B, untied head
    p = plan(system="polaris", nodes=64, model="llama3-70b", recompute="block")
    assert p.fitting and p.ranks == 256


def test_tensor_and_sequence_parallelism_divide_activation_memory():
    """Korthikanti et al. 2022 for GPT-2: 10 + 24/t words per s b h with tp, and all 34
    divided by t with sp (the trainer's column-parallel layers keep their rank's tokens
    and gather them again in backward)."""
    gpt, llama = preset_shape("gpt2", vocab_size=50304), preset_shape("llama3-8b")
    one = pm.activation_bytes_per_layer(gpt, 1, "bf16", True)
    assert pm.activation_bytes_per_layer(gpt, 1, "bf16", True, tp=4) == \
        pytest.approx(one * (10 + 24 / 4) / 34)
    assert pm.activation_bytes_per_layer(gpt, 1, "bf16", True, tp=4, sp=True) == \
        pytest.approx(one / 4)
    h = llama.n_embd
    whole = pm.llama_bytes_per_token(llama, "bf16")
    tp = pm.llama_bytes_per_token(llama, "bf16", tp=4)
    sp = pm.llama_bytes_per_token(llama, "bf16", tp=4, sp=True)
    assert whole > tp > sp == pytest.approx(whole / 4)
    assert tp - sp == pytest.approx(3 / 4 * (8 * h + 4 * h + 4 * h))  # norms, inputs
    sys_ = load_perf("polaris")
    arr = pm.Arrangement(ranks=8, global_batch=8, dtype="bf16", loss_chunk=-1)
    mem = [pm.predict(sys_, llama, dataclasses.replace(arr, tp=t, sequence_parallel=s,
                                                       global_batch=8 // t))  # 1 row each
           .memory_terms for t, s in ((1, False), (4, False), (4, True))]
    assert mem[0]["activations"] > mem[1]["activations"] > mem[2]["activations"]
    assert mem[1]["model_state"] < mem[0]["model_state"] / 3  # weights split, norms not
    assert mem[1]["logits"] < mem[0]["logits"] / 3  # a slice of the vocabulary


def test_tensor_parallel_collectives_count_the_layers_sums():
    """4 sums of (B, T, C) per layer and micro-batch (2 more with recomputation), 2 for
    the embedding and head, 3 small ones for the loss; sp swaps each for a pair and
    gathers each column-parallel input again in backward (2 per layer)."""
    from hpctrain.scaling import tensor_cost

    calls = []
    cost = lambda kind, n: calls.append((kind, n)) or 1.0  # noqa: E731
    t = tensor_cost.group_time(cost, tp=2, tokens=10, width=8, layers=3, dtype="bf16",
                               collectives="mpi", recompute=False, sp=False)
    assert t == 3 * 4 + 2 + 3
    assert calls == [("allreduce", 10 * 8 * 4.0), ("allreduce", 10 * 4.0)]  # MPI: fp32 sums
    calls.clear()
    t = tensor_cost.group_time(cost, tp=2, tokens=10, width=8, layers=3, dtype="bf16",
                               collectives="xccl", recompute=True, sp=True)
    assert t == 2 * (3 * 6 + 2) + 3 * 2 + 3
    assert ("allgather", 10 * 8 * 2.0) in calls and ("reduce_scatter", 10 * 8 * 2.0) in calls
    sys_ = load_perf("polaris")
    shape = preset_shape("gpt3-6.7b", vocab_multiple=64)
    arr = pm.Arrangement(ranks=8, global_batch=16, dtype="bf16", micro_batches=2)
    plain, split = pm.predict(sys_, shape, arr), pm.predict(sys_, shape,
                                                            dataclasses.replace(arr, tp=4))
    assert plain.tp_comm_s == 0.0 and split.tp_comm_s > 0.0
    assert split.step_s == pytest.approx(split.compute_s + split.tp_comm_s + split.bubble_s
                                         + split.p2p_s + split.grad_comm_s + split.gather_s
                                         + split.optimizer_s)
    assert split.grad_comm_total_s < plain.grad_comm_total_s  # a quarter of the gradients
    # A group of adjacent ranks inside a node never touches the network between nodes.
    slow_network = dataclasses.replace(sys_, inter=comm_cost.Link(1e-3, 1e6))
    assert pm.predict(slow_network, shape, dataclasses.replace(arr, tp=4)).tp_comm_s == \
        pytest.approx(split.tp_comm_s)


def test_tensor_parallel_layouts_are_checked():
    gpt2 = preset_shape("gpt2")
    with pytest.raises(UserError, match="vocab_multiple"):  # 50257 rows do not split
        pm.Arrangement(ranks=2, tp=2, global_batch=2).check(gpt2)
    with pytest.raises(UserError, match="n_head=12 is not a multiple of --parallel.tp=8"):
        pm.Arrangement(ranks=8, tp=8, global_batch=8).check(dataclasses.replace(gpt2,
                                                                                vocab_size=50304))
    with pytest.raises(UserError, match="needs tp > 1"):
        pm.Arrangement(ranks=2, sequence_parallel=True, global_batch=2).check(gpt2)


# MosaicML's published MPT training throughput on one node of 8 A100 80GB (bf16, FSDP
# full sharding, no recomputation, sequence 2048): llm-foundry,
# scripts/train/benchmarking/README.md, table "A100 80GB with 1600 Gbps node-node
# interconnect": (layers, heads, width, vocabulary, micro-batch, accumulation, tok/s/GPU).
PUBLISHED_MPT = {"mpt-125m": (12, 12, 768, 50368, 40, 2, 142830),
                 "mpt-1b": (24, 16, 2048, 50368, 14, 4, 20513),
                 "mpt-7b": (32, 32, 4096, 50432, 6, 2, 4641),
                 "mpt-13b": (40, 40, 5120, 50368, 2, 3, 2262)}


def _a100_80gb_node():
    """Polaris's A100 system as an 8-GPU node of A100 80GB (2039 GB/s, data sheet)."""
    return dataclasses.replace(load_perf("polaris", collectives="xccl"), ranks_per_node=8,
                               device_memory=80 * 2 ** 30, memory_bandwidth=2039e9)


@pytest.mark.parametrize("name", list(PUBLISHED_MPT))
def test_compute_term_matches_published_a100_runs_of_every_size(name):
    layers, heads, width, vocab, rows, accum, measured = PUBLISHED_MPT[name]
    shape = ModelShape(layers, heads, width, 2048, vocab)
    arr = pm.Arrangement(ranks=8, zero=3, micro_batches=accum, global_batch=8 * rows * accum,
                         dtype="bf16")
    predicted = pm.predict(_a100_80gb_node(), shape, arr).tokens_per_s / 8
    assert predicted / measured == pytest.approx(1.0, abs=0.25)


def test_the_achieved_rate_rises_with_width():
    """One rate for every width (no memory-bound term) predicts MPT-7B 30% slow; the
    width-dependent term does not."""
    flat = dataclasses.replace(_a100_80gb_node(), memory_bandwidth=0.0,
                               achieved_flops={"bf16": 140e12})
    layers, heads, width, vocab, rows, accum, measured = PUBLISHED_MPT["mpt-7b"]
    arr = pm.Arrangement(ranks=8, zero=3, micro_batches=accum, global_batch=8 * rows * accum,
                         dtype="bf16")
    shape = ModelShape(layers, heads, width, 2048, vocab)
    assert pm.predict(flat, shape, arr).tokens_per_s / 8 / measured < 0.75
    mfu = [pm.predict(_a100_80gb_node(), preset_shape(n), pm.Arrangement(
        ranks=8, global_batch=8, dtype="bf16")).mfu for n in ("gpt2", "gpt2-xl", "gpt3-13b")]
    assert mfu == sorted(mfu) and mfu[0] < 0.8 * mfu[-1]


def test_plan_options_are_checked_and_off_by_default():
    assert all(c.arrangement.recompute == "none" and c.arrangement.loss_chunk == 0
               for c in plan(system="polaris", nodes=2, model="gpt2").fitting)
    with pytest.raises(UserError, match="recompute 'all'"):
        pm.Arrangement(ranks=1, recompute="all").check(preset_shape("gpt2"))
    with pytest.raises(UserError, match="loss_chunk -2"):
        pm.Arrangement(ranks=1, loss_chunk=-2).check(preset_shape("gpt2"))


def test_plan_refuses_a_model_that_cannot_fit():
    with pytest.raises(UserError, match="does not fit"):
        plan(system="polaris", nodes=1, model="gpt3-13b", dtype="fp32")
    with pytest.raises(UserError, match="unknown system"):
        plan(system="summit", nodes=1, model="gpt2")


def test_every_preset_plans_on_a_login_node_quickly():
    # hpctrain plan runs on login nodes: predictions are arithmetic, no tensors.
    from hpctrain.scaling.models import presets

    for name, fields in presets().items():
        # Llama's 8K context: plan with the recipe's recomputation and chunked loss
        opts = {"recompute": "block", "loss_chunk": 4096} if fields.get("arch") == "llama" \
            else {}
        if name != "default":
            assert plan(system="aurora", nodes=64, model=name, **opts).fitting


def test_calibration_workers_rebuild_the_model_a_key_names():
    from hpctrain.scaling.calib_worker import config_from_key

    for shape in (preset_shape("default"), preset_shape("llama3-8b", block_size=64, n_layer=1)):
        cfg = config_from_key(shape.key)
        assert (cfg.arch, cfg.n_kv_head, cfg.ffn_hidden, cfg.n_embd) == \
            (shape.arch, shape.n_kv_head, shape.ffn_hidden, shape.n_embd)


def test_llama3_8b_has_its_published_parameter_count():
    """8,030,261,248: Meta's count for Llama 3 8B (untied head, GQA with 8 key/value
    heads, SwiGLU 14336); FLOPs per token 6N + 12 L C T with N without the embedding."""
    shape = preset_shape("llama3-8b")
    assert shape.params == 8_030_261_248
    n = shape.params - 128256 * 4096  # the embedding is a lookup; the head multiplies
    assert shape.flops_per_token == 6 * n + 12 * 32 * 4096 * 8192


def test_the_collective_library_has_its_own_links_and_overlap():
    """--collectives picks whose figures the model uses: MPI's, or the GPU library's
    ([perf.network.xccl]); auto takes the library where the system has its figures."""
    mpi, lib, auto = (load_perf("polaris", collectives=c) for c in ("mpi", "xccl", "auto"))
    assert (mpi.collectives, lib.collectives, auto.collectives) == ("mpi", "xccl", "xccl")
    assert lib.intra.bandwidth > mpi.intra.bandwidth and lib.overlap > mpi.overlap
    assert load_perf("local", collectives="auto").collectives == "mpi"  # no figures there
    with pytest.raises(UserError, match=r"\[perf.network.xccl\].*--collectives mpi"):
        load_perf("local", collectives="xccl")
    shape = preset_shape("gpt2-xl")
    arr = pm.Arrangement(ranks=64, global_batch=512, zero=1)
    faster, slower = pm.predict(lib, shape, arr), pm.predict(mpi, shape, arr)
    assert faster.grad_comm_s < slower.grad_comm_s
    assert faster.compute_s == slower.compute_s  # only the network changed


def test_zbv_terms_come_from_its_simulation():
    """zbv: the simulator's bubble (below zb-h1's with equal pass times), p + 1
    whole-stage micro-batches held until W; fewer than 2 p micro-batches refused."""
    from hpctrain.parallel.pipeline.schedules import predicted_bubble
    for p, m in ((2, 4), (4, 8), (4, 16)):
        assert pm.bubble_fraction(p, m, "zbv") == pytest.approx(predicted_bubble("zbv", p, m))
    assert pm.bubble_fraction(4, 8, "zbv") < pm.bubble_fraction(4, 8, "zb-h1")
    assert pm.micro_batches_in_flight(4, 8, "zbv") == 5
