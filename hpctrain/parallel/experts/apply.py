"""``expert_parallelize``: this rank's slice of every MoE layer's experts, and the
dispatch that sends each token copy to the rank holding its expert.

Every rank built the same whole model from the same seed, so rank ``r`` of an expert
group of ``ep`` keeps global experts ``[r E/ep, (r + 1) E/ep)`` of every layer and the
group together holds each expert once. The kept parameters carry an ``ExpertSlice``
(``EXPERT_SLICE``): the gradient engines reduce them over the ranks holding the same
experts only, and checkpoints join the slices as they join tensor-parallel ones.
"""

from __future__ import annotations

import torch

from hpctrain.model.common.experts import Experts
from hpctrain.model.common.moe import moe_layers
from hpctrain.model.plan import ShardSpec
from hpctrain.parallel.experts.dispatch import ExpertParallelDispatch

EXPERT_SLICE = "expert_parallel_slice"
"""The attribute an expert-parallel parameter carries: its ``ShardSpec`` (dimension 0,
the experts)."""


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` holds this rank's slice of a layer's experts."""
    return getattr(param, EXPERT_SLICE, None) is not None


class _Open:
    """What the grid's resources hold of the dispatch: true until ``Free`` closes it (as
    an MPI handle is until freed)."""

    def __init__(self, dispatch):
        self.dispatch, self.open = dispatch, True

    def Free(self) -> None:
        self.dispatch.close()
        self.open = False

    def __bool__(self) -> bool:
        return self.open


def expert_parallelize(model: torch.nn.Module, ep_comm, world, resources=None) -> int:
    """Keep this rank's experts of every MoE layer of ``model`` (a GPT or a pipeline
    stage) and exchange tokens over ``ep_comm`` (``ProcessGrid.ep_comm``; ``world``: the
    device, GPU awareness and deadline), one dispatch for every layer, which
    ``resources`` (the grid's) closes with the grid. Returns the number of layers
    changed."""
    ep, rank = ep_comm.Get_size(), ep_comm.Get_rank()
    layers = moe_layers(model)
    dispatch = ExpertParallelDispatch.of_world(ep_comm, world)
    if resources is not None and hasattr(dispatch, "close"):
        resources.add(_Open(dispatch))
    for layer in layers:
        for experts in [m for m in layer.modules() if isinstance(m, Experts)]:
            total = experts.n_experts
            if total % ep:
                raise ValueError(f"{total} experts cannot be shared out over {ep} ranks")
            count = total // ep
            experts.keep(rank * count, count)
            for p in experts.parameters(recurse=False):
                setattr(p, EXPERT_SLICE, ShardSpec(dim=0, parts=(total,)))
        layer.dispatch = dispatch
    return len(layers)
