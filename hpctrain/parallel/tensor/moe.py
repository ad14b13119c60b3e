"""Tensor parallelism inside a mixture of experts: every rank of the group routes every
token of the group alike and computes its slice of each expert's hidden units
(Megatron-LM's tensor-parallel experts).

A routed expert is an MLP, so it is split as the dense MLP is: its input projection by
hidden units (gate and up rows per part), its output projection by the same columns;
the shared experts likewise. The layer's input is whole on every rank (``copy_to_group``;
under sequence parallelism every rank's tokens gathered), each rank's output is a
partial sum over its hidden units, and the group adds them up once for the whole layer
(allreduce, or reduce-scatter onto the sequence slices), after the routing weights, so
one collective in each direction serves every expert. What every rank then computes
alike (the routing scores, the auxiliary losses) is whole; the weight gradients of the
layer's whole parameters (routing and gating) are partial sums (they multiply partial
outputs) and are summed over the group; the auxiliary losses' gradient is added on every rank, so each adds
1/tp of it. docs/design/moe.md ("Tensor parallelism inside an expert").
"""

from __future__ import annotations

import torch

from hpctrain.model.common.moe import MoE
from hpctrain.parallel.tensor.group import TensorParallelGroup
from hpctrain.parallel.tensor.layers import split_parameter
from hpctrain.parallel.tensor.mappings import (copy_to_group, gather_from_sequence,
                                               reduce_from_group, reduce_scatter_to_sequence,
                                               sum_gradient_over_group)


class MoETensorParallel:
    def __init__(self, group: TensorParallelGroup, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel
        self.aux_share = 1.0 / group.size

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return (gather_from_sequence(x, self.group) if self.sequence_parallel
                else copy_to_group(x, self.group))

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        return (reduce_scatter_to_sequence(y, self.group) if self.sequence_parallel
                else reduce_from_group(y, self.group))


def split_moe(moe: MoE, path: str, cfg, plan, group: TensorParallelGroup,
              sequence_parallel: bool) -> None:
    """Make the MoE layer at ``path`` (its name in the model, for the plan's specs) this
    rank's tensor-parallel part of it, in place (``check_tensor_parallel`` refused a
    model with biases: the shared experts' output bias would be added on every rank)."""
    for name, module in moe.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            full = f"{path}.{name}.{pname}" if name else f"{path}.{pname}"
            spec = plan.shard_spec(full, cfg)
            if spec is not None:
                setattr(module, pname, split_parameter(param, spec, group))
            else:  # whole, applied to partial sums: the routing and gating weights
                sum_gradient_over_group(param, group)
    moe.tensor_parallel = MoETensorParallel(group, sequence_parallel)
