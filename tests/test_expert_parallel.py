"""Expert parallelism in one process: the layout checks (``config/checks.py``), buckets
cut by kind (``bucketing.split_by_kind``), the experts a rank keeps and how their
slices join (``experts/apply.py``, ``TensorSplit``), and the start-up line's count.
The training runs against the reference: ``test_expert_parallel_mpi.py``."""

import pytest
import torch

from hpctrain.config import build_config, check_layout
from hpctrain.errors import ConfigError
from hpctrain.model.gpt import GPT
from hpctrain.model.shape import GPTConfig
from hpctrain.parallel.bucketing import split_by_kind
from hpctrain.parallel.experts.apply import EXPERT_SLICE, is_expert
from hpctrain.parallel.tensor.layout import shard, unshard

MOE = {"arch": "llama", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
       "ffn_hidden": 48, "moe_experts": 4}


def _cfg(model=None, **parallel):
    return build_config({"model": {**MOE, **(model or {})}, "parallel": parallel,
                         "train": {"batch_size": 8}})


@pytest.mark.parametrize("model,parallel,ranks,message", [
    ({"moe_experts": 0}, {"ep": 2}, 2, r"has none; set --model.moe_experts"),
    ({"moe_experts": 6}, {"ep": 4}, 4, r"moe_experts=6 cannot be shared out.*1, 2, 3, 6"),
    ({}, {"ep": 4}, 2, r"drawn from the 2 data-parallel replica\(s\); use a divisor of "
                       r"both \(1, 2\)"),
    ({}, {"tp": 2, "ep": 2}, 4, r"--parallel.ep=2 with --parallel.tp=2: expert and tensor"),
    ({}, {"cp": 2}, 2, r"the balancing loss needs each whole sequence"),
])
def test_bad_expert_layouts_name_the_fix(model, parallel, ranks, message):
    with pytest.raises(ConfigError, match=message):
        check_layout(_cfg(model, **parallel), ranks)


def test_expert_parallelism_fits_inside_data_parallel_and_pipelines():
    check_layout(_cfg(ep=2), 4)  # dp = 4, ep = 2
    check_layout(_cfg(tp=2), 4)  # each expert split over tp
    check_layout(_cfg(ep=2, pp=2, micro_batches=2), 4)  # dp = 2 per stage


def test_buckets_never_mix_experts_with_the_rest():
    kinds = [False, True, True, False, True]
    assert split_by_kind([[0, 1, 2], [3, 4]], kinds) == [[0], [1, 2], [3], [4]]
    assert split_by_kind([[0], [1, 2]], kinds) == [[0], [1, 2]]


def test_each_rank_keeps_its_experts_and_the_slices_join_whole():
    """What expert_parallelize does to a layer's experts, at ep = 2, by hand: rank r's
    slice is experts [2r, 2r + 2), and the slices join into the whole stacked tensors."""
    torch.manual_seed(0)
    whole = GPT(GPTConfig(**MOE, vocab_size=64))
    name, w_in = next((n, p) for n, p in whole.named_parameters() if n.endswith("w_in"))
    assert w_in.shape[0] == 4
    from hpctrain.model.plan import ShardSpec

    spec = ShardSpec(dim=0, parts=(4,))
    slices = [shard(w_in.detach(), spec, r, 2) for r in range(2)]
    assert torch.equal(slices[1], w_in.detach()[2:4])
    assert torch.equal(unshard(slices, spec), w_in.detach())
    p = torch.nn.Parameter(slices[0])
    assert not is_expert(p)
    setattr(p, EXPERT_SLICE, spec)
    assert is_expert(p)


def test_the_start_line_counts_total_and_active_parameters():
    moe = GPTConfig(**MOE, vocab_size=64)
    assert moe.parameters_text() == (f"{moe.num_params() / 1e6:.2f}M parameters "
                                     f"({moe.active_params() / 1e6:.2f}M active)")
    assert moe.active_params() < moe.num_params()
    dense = GPTConfig(**{**MOE, "moe_experts": 0}, vocab_size=64)
    assert dense.parameters_text() == f"{dense.num_params() / 1e6:.2f}M parameters"
