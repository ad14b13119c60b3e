"""What expert parallelism changes in a step, as the performance model counts it: the
parameters a rank holds, the groups its gradients are reduced over, and the all-to-all
exchanges of tokens (Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch
Transformer"). Pure functions.

The ``ep`` ranks of an expert-parallel group are neighbours in the dp x cp index (ranks
laid out tp innermost, then cp, then pp, then dp); each holds 1/ep of every MoE block's
routed experts. Per MoE block and micro-batch every rank sends each of its tokens' hidden
vectors to the ``moe_top_k`` experts it is routed to and takes the results back: two
all-to-alls in forward (dispatch, combine), two in backward (their gradients), two more
when the block runs again for recomputation. Routing is taken as balanced. The formulas:
docs/design/moe.md ("In the planner").
"""

from __future__ import annotations

from hpctrain.scaling.activations import word_bytes
from hpctrain.scaling.arrangement import Arrangement
from hpctrain.scaling.models import ModelShape

EXCHANGES_PER_BLOCK = 4
"""Dispatch and combine in forward, and their gradients in backward."""
RECOMPUTED_EXCHANGES = 2
"""Dispatch and combine again when a recomputed block runs its forward in backward."""


def rank_param_split(shape: ModelShape, arrangement: Arrangement,
                     total: float) -> tuple[float, float]:
    """(dense, expert) parameters on the busiest rank, whose ``total`` (every expert of
    its stage, ``tensor_cost.rank_params``) splits into the dense ones and its 1/ep of the
    routed experts (their matrices split over tp like any other)."""
    experts = shape.stage_expert_params(arrangement.pp) / arrangement.tp
    return total - experts, experts / arrangement.ep


def state_params(dense: float, experts: float, arrangement: Arrangement) -> float:
    """Parameters whose optimizer state one rank updates: with ZeRO its shard of the dense
    ones over dp x cp, and of its experts over the dp x cp / ep ranks holding the same."""
    if arrangement.zero == 0:
        return dense + experts
    return dense / arrangement.grad_group + experts / arrangement.expert_group


def _rank(arrangement: Arrangement, j: int) -> int:
    """The rank at dp x cp index ``j`` (pp and tp index 0)."""
    a = arrangement
    return (j // a.cp) * (a.pp * a.cp * a.tp) + (j % a.cp) * a.tp


def members_on_node(arrangement: Arrangement, ranks_per_node: int, indices) -> int:
    """Members of the group at dp x cp ``indices`` sharing the first member's node."""
    nodes = [_rank(arrangement, j) // ranks_per_node for j in indices]
    return max(1, nodes.count(nodes[0]))


def ep_members_on_node(arrangement: Arrangement, ranks_per_node: int) -> int:
    """Of an expert-parallel group (ep neighbours in dp x cp): those on one node."""
    return members_on_node(arrangement, ranks_per_node, range(arrangement.ep))


def expert_group_members_on_node(arrangement: Arrangement, ranks_per_node: int) -> int:
    """Of the ranks holding the same experts (every ep-th in dp x cp): those on one node."""
    return members_on_node(arrangement, ranks_per_node,
                           range(0, arrangement.grad_group, arrangement.ep))


def dispatch_bytes(shape: ModelShape, arrangement: Arrangement) -> float:
    """Bytes one rank sends into one all-to-all: each of its tokens' hidden vector, once
    per routed expert (``moe_top_k``). A rank holds s/cp tokens of each of its sequences,
    and 1/tp of those under sequence parallelism."""
    a = arrangement
    tokens = a.micro_rows * shape.block_size / a.cp / (a.tp if a.sequence_parallel else 1)
    return tokens * shape.moe_top_k * shape.n_embd * word_bytes(a.dtype)


def moe_blocks_on_stage(shape: ModelShape, pp: int) -> int:
    """MoE blocks of the busiest stage (the one whose parameters the model counts)."""
    return sum(1 for i in shape.busiest_stage(pp) if shape.experts_per_block[i])


def exchange_time(all_to_all, shape: ModelShape, arrangement: Arrangement,
                  recomputed_share: float) -> float:
    """Seconds of one micro-batch's all-to-alls on the busiest stage; ``all_to_all(n)``
    prices one exchange of n bytes per rank over the expert-parallel group;
    ``recomputed_share``: the stage's share of blocks run again in backward."""
    if arrangement.ep <= 1 or not shape.moe_experts:
        return 0.0
    blocks = moe_blocks_on_stage(shape, arrangement.pp)
    exchanges = EXCHANGES_PER_BLOCK + RECOMPUTED_EXCHANGES * recomputed_share
    return blocks * exchanges * all_to_all(dispatch_bytes(shape, arrangement))
