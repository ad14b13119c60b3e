"""The planner and performance model on a mixture of experts: per-block counts, the
``ep`` dimension (refusals, expert memory over ep, expert gradients over dp x cp / ep),
the all-to-all's bytes and time, and plans for Mixtral 8x7B. One process, arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR, UserError
from hpctrain.parallel.memory import zero_formula
from hpctrain.scaling import comm_cost, expert_cost
from hpctrain.scaling import perfmodel as pm
from hpctrain.scaling.models import ModelShape, parse_shape, preset_shape
from hpctrain.scaling.planner import Fixed, plan, table
from hpctrain.scaling.system_perf import load_perf

LINK = comm_cost.Link(alpha_s=1e-5, bandwidth=1e11)
SLOW = comm_cost.Link(alpha_s=2e-5, bandwidth=2.5e10)


def _moe(**fields) -> ModelShape:
    base = dict(n_layer=3, n_head=4, n_embd=64, block_size=32, vocab_size=97, arch="llama",
                n_kv_head=2, ffn_hidden=96, moe_experts=4, moe_top_k=2, moe_every=2)
    return ModelShape(**{**base, **fields})


def _mixtral_arrangement(**fields) -> pm.Arrangement:
    """Mixtral on 16 Polaris nodes: pp=2 x tp=4 (tp=1 where ep > 1 is checked: the
    trainer does not combine them yet)."""
    base = dict(ranks=64, pp=2, tp=4, sequence_parallel=True, zero=1, micro_batches=64,
                global_batch=512, dtype="bf16")
    return pm.Arrangement(**{**base, **fields})


def _checked(**fields) -> pm.Arrangement:
    """``_mixtral_arrangement`` without tensor parallelism: one that passes ``check``."""
    return _mixtral_arrangement(tp=1, sequence_parallel=False, micro_batches=16, **fields)


def test_the_mixtral_preset_has_the_published_counts():
    shape = preset_shape("mixtral-8x7b")
    assert shape.params == pytest.approx(46.7e9, rel=2e-3)  # Mistral AI: 46.7B
    embedding = shape.params - shape.params_non_embedding  # the untied token embedding
    assert shape.gpt.active_params() + embedding == pytest.approx(12.9e9, rel=5e-3)  # 12.9B
    attention = 12.0 * 32 * 4096 * 4096  # 12 L C T
    assert shape.flops_per_token == 6.0 * shape.gpt.active_params() + attention
    dense = dataclasses.replace(shape, moe_experts=0, name="")
    assert shape.key != dense.key and "E8k2" in shape.key
    assert dense.key == "L32-H32-C4096-T4096-V32000-llama-KV8-F14336"  # as calibrations wrote


def test_blocks_are_counted_one_by_one_when_only_some_are_moe():
    shape = _moe()  # blocks 0 and 2 dense, block 1 a MoE block
    dense, moe, _ = shape.params_per_block
    assert dense == shape.gpt.block_params() and moe > dense
    assert shape.params_per_block == (dense, moe, dense)
    assert sum(shape.params_per_block) + shape.embedding_params == shape.params_non_embedding
    assert 3 * shape.layer_flops_per_token + shape.head_flops_per_token == pytest.approx(
        shape.flops_per_token)
    assert shape.experts_per_block == (0, 4 * 3 * 64 * 96, 0)
    # stages of 2 + 1 blocks hold blocks 0-1 (the MoE one among them) and block 2
    assert shape.stage_params(2) == dense + moe + shape.embedding_params
    assert shape.stage_params(3) == moe + shape.embedding_params  # the MoE block's stage
    assert shape.stage_expert_params(3) == shape.stage_expert_params(1) == 4 * 3 * 64 * 96
    assert shape.stage_flops_per_token(1) == pytest.approx(
        shape.flops_per_token - shape.head_flops_per_token)


@pytest.mark.parametrize("change", [dict(moe_experts=8), dict(moe_top_k=1), dict(moe_shared=1),
                                    dict(moe_every=1), dict(moe_ffn_hidden=32)])
def test_the_key_tells_moe_shapes_apart(change):
    assert _moe(**change).key != _moe().key


def test_shape_takes_moe_keys():
    shape = parse_shape("n_layer=4,n_embd=64,n_head=4,vocab=100,ffn=128,experts=8,top_k=2,"
                        "shared=1,moe_ffn=32,moe_every=2")
    assert (shape.arch, shape.moe_experts, shape.moe_top_k, shape.moe_shared,
            shape.moe_ffn_hidden, shape.moe_every) == ("llama", 8, 2, 1, 32, 2)
    assert parse_shape("n_layer=2,n_embd=64,n_head=4,vocab=100,experts=4,shared=0").moe_shared == 0
    with pytest.raises(UserError, match="moe_top_k=9 must be between 1 and moe_experts=8"):
        parse_shape("n_layer=2,n_embd=64,n_head=4,vocab=100,experts=8,top_k=9")
    with pytest.raises(UserError, match="keys among .*experts"):
        parse_shape("n_layer=2,n_embd=64,n_head=4,vocab=100,routers=8")


@pytest.mark.parametrize("ep, match", [(3, "ep=3 must divide both dp x cp = 32 and the 8 "
                                           "experts"),
                                       (16, "ep=16 must divide both"),
                                       (0, "ep=0 must divide both")])
def test_an_ep_that_does_not_divide_is_refused_with_one_message(ep, match):
    shape = preset_shape("mixtral-8x7b")
    with pytest.raises(UserError, match=match):
        _checked(ep=ep).check(shape)
    with pytest.raises(UserError, match="has none; use ep=1"):
        _checked(ep=2).check(preset_shape("llama3-8b"))
    _checked(ep=8).check(shape)
    with pytest.raises(UserError, match="ep=2 with tp=4: expert and tensor parallelism"):
        _mixtral_arrangement(ep=2).check(shape)
    with pytest.raises(UserError, match="cp=2 with a mixture of experts"):
        _checked(cp=2).check(shape)


@pytest.mark.parametrize("args, match", [
    (["--ep", "3"], "--ep 3 must divide both dp x cp (a divisor of 64) and the 8 experts"),
    (["--dp", "2", "--cp", "1", "--ep", "4"], "--ep 4 must divide both dp x cp = 2"),
    (["--ep", "16"], "the 8 experts; use a common divisor"),
])
def test_the_planner_refuses_an_ep_once(capsys, args, match):
    code = main(["plan", "--system", "polaris", "--nodes", "16", "--model", "mixtral-8x7b",
                 *args])
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR and match in err and err.count("\n") == 1
    assert main(["plan", "--system", "polaris", "--nodes", "16", "--model", "llama3-8b",
                 "--ep", "2"]) == EXIT_USER_ERROR
    assert "llama3-8b has none" in capsys.readouterr().err


@pytest.mark.parametrize("zero", [0, 1])
def test_expert_memory_per_rank_divides_by_ep_and_dense_memory_does_not(zero):
    system, shape = load_perf("polaris"), preset_shape("mixtral-8x7b")
    terms = {ep: pm.predict_memory(system, shape, _mixtral_arrangement(ep=ep, zero=zero))[1]
             for ep in (1, 2, 4, 8)}
    experts = shape.stage_expert_params(2) / 4  # the busiest stage's, over tp = 4
    for ep, t in terms.items():
        group = 8 // ep  # the dp = 8 ranks holding the same experts
        assert t["expert_state"] == pytest.approx(zero_formula(zero, "bf16", group)
                                                  * experts / ep)
        for k in ("model_state", "activations", "logits", "base"):
            assert t[k] == terms[1][k]
    assert terms[8]["expert_state"] < terms[4]["expert_state"] < terms[1]["expert_state"]
    if zero == 0:
        assert terms[1]["expert_state"] == pytest.approx(8 * terms[8]["expert_state"])


def test_dispatch_bytes_count_every_routed_copy():
    arr = _mixtral_arrangement(ep=2)
    one, two = preset_shape("mixtral-8x7b", moe_top_k=1), preset_shape("mixtral-8x7b")
    tokens = 1 * 4096 / 4  # a micro-batch of one sequence, cut over tp = 4 (sp)
    assert expert_cost.dispatch_bytes(two, arr) == tokens * 2 * 4096 * 2
    assert expert_cost.dispatch_bytes(two, arr) == 2 * expert_cost.dispatch_bytes(one, arr)


def test_the_all_to_all_sends_ep_minus_one_over_ep_of_the_bytes():
    n = 8e6
    for p in (2, 4, 8):  # one node: (p - 1) steps, (p - 1)/p of the bytes over its fabric
        assert comm_cost.all_to_all(p, n, LINK, SLOW, members_per_node=8, ranks_per_node=8) \
            == pytest.approx((p - 1) * 1e-5 + (p - 1) / p * n / 1e11)
    assert comm_cost.all_to_all(1, n, LINK, SLOW, members_per_node=1, ranks_per_node=4) == 0.0
    # 8 ranks over 2 nodes of 4: half the bytes leave each node, whose 4 ranks share its NICs
    across = comm_cost.all_to_all(8, n, LINK, SLOW, members_per_node=4, ranks_per_node=4)
    assert across == pytest.approx(7 * 2e-5 + 4 * 0.5 * n / 2.5e10)


def test_all_to_all_time_grows_with_top_k_and_ep():
    system = load_perf("polaris", collectives="xccl")
    shape = preset_shape("mixtral-8x7b")
    t = {(k, ep): pm.expert_parallel_time(system, preset_shape("mixtral-8x7b", moe_top_k=k),
                                          _mixtral_arrangement(ep=ep), 16)
         for k in (1, 2) for ep in (1, 2, 4, 8)}
    assert t[(2, 1)] == t[(1, 1)] == 0.0  # every expert at home
    for ep in (2, 4, 8):
        assert 1.8 < t[(2, ep)] / t[(1, ep)] < 2.0  # twice the bytes, the same latency
    assert t[(2, 2)] < t[(2, 4)] < t[(2, 8)]
    per_exchange = t[(2, 2)] / (16 * expert_cost.EXCHANGES_PER_BLOCK)  # 16 MoE blocks a stage
    members = expert_cost.ep_members_on_node(_mixtral_arrangement(ep=2), 4)
    assert members == 1  # ep neighbours are pp x tp = 8 ranks apart: on two nodes
    assert per_exchange == pytest.approx(comm_cost.all_to_all(
        2, expert_cost.dispatch_bytes(shape, _mixtral_arrangement(ep=2)), system.intra,
        system.inter, members_per_node=1, ranks_per_node=4))
    again = pm.expert_parallel_time(system, shape, _mixtral_arrangement(ep=2, recompute="block"),
                                    16)
    assert again == pytest.approx(t[(2, 2)] * 6 / 4)  # dispatch and combine once more
    pred = pm.predict(system, shape, _checked(ep=2))
    alone = pm.expert_parallel_time(system, shape, _checked(ep=2), 16)
    assert pred.ep_comm_s == pytest.approx(16 * alone)  # 16 micro-batches
    assert ("expert-parallel all-to-alls (exposed)", f"{pred.ep_comm_s * 1e3:.2f} ms") \
        in pm.describe(pred)


def test_expert_gradients_are_reduced_over_dp_times_cp_over_ep():
    system, shape = load_perf("polaris"), preset_shape("mixtral-8x7b")
    arr = _mixtral_arrangement(ep=8)  # dp = 8: each expert on one rank, nothing to reduce
    dense, experts = expert_cost.rank_param_split(
        shape, arr, pm.tensor_cost.rank_params(shape, 2, 4))
    assert arr.expert_group == 1 and experts == pytest.approx(shape.stage_expert_params(2) / 32)
    alone = pm.gradient_terms(system, arr, dense, 16, 0.1)
    assert pm.gradient_terms(system, arr, dense, 16, 0.1, experts) == alone
    two = dataclasses.replace(arr, ep=2)
    _, experts2 = expert_cost.rank_param_split(shape, two,
                                               pm.tensor_cost.rank_params(shape, 2, 4))
    assert pm.gradient_terms(system, two, dense, 16, 0.1, experts2)[1] > alone[1]


def test_mixtral_on_16_polaris_nodes_needs_ep_without_tensor_parallelism(capsys):
    """tp=1, ZeRO-1, pp=8, blocks recomputed: only a spread of the experts fits."""
    fixed = dict(tp=1, pp=8, zero=1)
    p = plan(system="polaris", nodes=16, model="mixtral-8x7b", fixed=Fixed(**fixed),
             recompute="block")
    assert p.fitting and all(c.arrangement.ep > 1 for c in p.fitting)
    best = p.fitting[0]
    assert best.prediction.memory_bytes <= p.system.device_memory
    with pytest.raises(UserError, match="does not fit"):
        plan(system="polaris", nodes=16, model="mixtral-8x7b", fixed=Fixed(**fixed, ep=1),
             recompute="block")
    free = plan(system="polaris", nodes=16, model="mixtral-8x7b")  # tp=4 inside the experts
    assert free.fitting[0].arrangement.tp > 1 and free.fitting[0].arrangement.ep == 1
    text = table(p)
    assert " ep " in text.splitlines()[2] and "experts GiB" in text
    assert " ep " not in table(plan(system="polaris", nodes=2, model="gpt2")).splitlines()[2]


def test_mixtral_on_aurora_plans_with_experts_spread():
    p = plan(system="aurora", nodes=16, model="mixtral-8x7b", fixed=Fixed(tp=1))
    assert p.fitting[0].arrangement.ep > 1
    assert p.fitting[0].prediction.memory_bytes <= p.system.device_memory


def test_a_moe_block_keeps_its_experts_hidden_tensors_and_the_routed_copies():
    from hpctrain.scaling.activations import activation_bytes_per_layer, moe_bytes_per_token

    moe = preset_shape("mixtral-8x7b")
    dense = dataclasses.replace(moe, moe_experts=0, name="")
    extra = (activation_bytes_per_layer(moe, 1, "bf16", True, 4, True)
             - activation_bytes_per_layer(dense, 1, "bf16", True, 4, True))
    # one more expert's gate/up, SiLU and product (4 H words over tp), 2 k C words (sp),
    # the router's 8 fp32 probabilities, per token
    per_token = 2 * (4 * 14336 / 4 + 2 * 2 * 4096 / 4) + 4 * 8
    assert moe_bytes_per_token(moe, "bf16", 4.0, 4, True) == per_token
    assert extra == pytest.approx(4096 * per_token)
    half = preset_shape("mixtral-8x7b", moe_every=2)  # every other block routes
    assert moe_bytes_per_token(half, "bf16", 4.0, 4, True) == per_token / 2
