"""The places where activations cross a tensor-parallel group, as autograd functions:
each pairs a forward collective with its conjugate in backward (Megatron-LM's f and g
operators, and their sequence-parallel forms; Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4.2.2).

``copy_to_group`` and ``reduce_from_group`` guard the column- and row-parallel layers;
the ``*_sequence`` functions and ``sequence_gathered_linear`` replace them under
sequence parallelism, so that no tensor a block keeps for backward is whole. The table
of forwards and backwards, and why each backward is what it is:
``docs/design/tensor-parallel.md`` ("The mappings", "Sequence parallelism").
"""

from __future__ import annotations

import torch

from hpctrain.parallel.tensor.group import TensorParallelGroup

SEQUENCE_DIM = 1
"""The token dimension of the residual stream (B, T, C)."""


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.allreduce(grad), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        return group.allreduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return x.chunk(group.size, SEQUENCE_DIM)[group.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, SEQUENCE_DIM), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return group.all_gather(x, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.reduce_scatter(grad, SEQUENCE_DIM), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: TensorParallelGroup):
        ctx.group = group
        return group.reduce_scatter(x, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return ctx.group.all_gather(grad, SEQUENCE_DIM), None


class _SequenceGatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group: TensorParallelGroup):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # this rank's tokens only
        return torch.nn.functional.linear(group.all_gather(x, SEQUENCE_DIM), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = ctx.group.all_gather(x, SEQUENCE_DIM)
        grad_x = ctx.group.reduce_scatter(grad.matmul(weight), SEQUENCE_DIM)
        rows = grad.reshape(-1, grad.size(-1))
        grad_weight = rows.t().matmul(whole.reshape(-1, whole.size(-1)))
        grad_bias = rows.sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def sequence_gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group: TensorParallelGroup) -> torch.Tensor:
    """``F.linear`` of every rank's tokens gathered, keeping only ``x`` for backward."""
    return _SequenceGatheredLinear.apply(x, weight, bias, group)


def copy_to_group(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    return _ScatterToSequence.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    return _ReduceScatterToSequence.apply(x, group)


def sum_gradient_over_group(param: torch.nn.Parameter, group: TensorParallelGroup) -> None:
    """Under sequence parallelism a parameter that every rank holds whole but applies to
    its own tokens only (a norm's weight, an output projection's bias) gets a partial
    gradient on each rank: sum it over the group as autograd produces it, before the
    gradient engine's hooks see it."""
    param.register_hook(group.allreduce)
