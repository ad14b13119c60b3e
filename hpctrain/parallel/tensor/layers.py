"""The tensor-parallel layers: a linear layer split by its outputs or by its inputs, and
an embedding split by its vocabulary (Megatron-LM's ``ColumnParallelLinear``,
``RowParallelLinear`` and ``VocabParallelEmbedding``).

Each is made from the whole layer of a built model (``split``) and keeps its parameter
names, so the engines, ZeRO and the checkpoints see the model's names with this rank's
slice; a sliced parameter carries its ``ShardSpec`` as ``tensor_parallel_split``. Linear
layers pair column then row, so one collective in each direction serves the pair.
``docs/design/tensor-parallel.md`` ("The layers").
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from hpctrain.model.plan import ShardSpec
from hpctrain.parallel.tensor.group import TensorParallelGroup
from hpctrain.parallel.tensor.layout import shard
from hpctrain.parallel.tensor.mappings import (copy_to_group, gather_from_sequence,
                                               reduce_from_group, reduce_scatter_to_sequence,
                                               sequence_gathered_linear,
                                               sum_gradient_over_group)

SPLIT = "tensor_parallel_split"
"""The attribute a split parameter carries: its ``ShardSpec``."""


def is_split(param: torch.Tensor) -> bool:
    """Whether ``param`` holds this rank's slice (not the whole tensor)."""
    return getattr(param, SPLIT, None) is not None


def split_parameter(param: torch.Tensor, spec: ShardSpec,
                    group: TensorParallelGroup) -> nn.Parameter:
    """This rank's slice of ``param`` as a new parameter that knows it is a slice."""
    sliced = nn.Parameter(shard(param.detach(), spec, group.rank, group.size),
                          requires_grad=param.requires_grad)
    setattr(sliced, SPLIT, spec)
    return sliced


def _shell_linear(cls, linear: nn.Linear, in_features: int, out_features: int):
    """An empty ``cls`` of the given size (no memory: its tensors are set after)."""
    return cls(in_features, out_features, bias=linear.bias is not None, device="meta")


class _SplitLinear(nn.Linear):
    """What the column- and row-parallel layers share: this rank's local product."""

    fp8 = None
    """``--train.fp8``'s product (``parallel/fp8.py``: ``x W^T`` in FP8, called with the
    layer's current weight), or None: ``F.linear``. A plain attribute, no submodule, so
    the layer's parameter and checkpoint names stay the model's."""

    def local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8 is None:
            return F.linear(x, self.weight, bias)
        y = self.fp8(x, self.weight)
        return y if bias is None else y + bias.to(y.dtype)


class ColumnParallelLinear(_SplitLinear):
    """y = x A^T + b with the rows of A (the output features) and of b split: this rank
    computes its slice of y's last dimension. The input is the whole activation
    (``copy_to_group``: its gradient is summed over the group in backward), or, under
    sequence parallelism, every rank's tokens gathered (reduce-scattered in backward;
    only this rank's tokens are kept for it: ``sequence_gathered_linear``). In FP8 the
    gathered input is kept instead (``gather_from_sequence``, then the FP8 product: its
    backward needs the whole input it multiplied)."""

    group: TensorParallelGroup
    sequence_parallel: bool

    @classmethod
    def split(cls, linear: nn.Linear, spec: ShardSpec, group: TensorParallelGroup,
              sequence_parallel: bool) -> "ColumnParallelLinear":
        layer = _shell_linear(cls, linear, linear.in_features,
                              linear.out_features // group.size)
        layer.weight = split_parameter(linear.weight, spec, group)
        if linear.bias is not None:
            layer.bias = split_parameter(linear.bias, spec, group)
        layer.group, layer.sequence_parallel = group, sequence_parallel
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.fp8 is None:
            return sequence_gathered_linear(x, self.weight, self.bias, self.group)
        x = (gather_from_sequence(x, self.group) if self.sequence_parallel
             else copy_to_group(x, self.group))
        return self.local_linear(x, self.bias)


class RowParallelLinear(_SplitLinear):
    """y = x A^T + b with the columns of A (the input features) split: this rank's input
    is its slice of x (what the column-parallel layer before it produced), its product
    a partial sum that the group adds up (allreduce, or reduce-scatter onto the
    sequence slices). The bias is whole and added once, after the sum; under sequence
    parallelism it is added to each rank's tokens only, so its gradient is summed over
    the group (``sum_gradient_over_group``). In FP8 only the local product is: the bias
    stays out of it."""

    group: TensorParallelGroup
    sequence_parallel: bool

    @classmethod
    def split(cls, linear: nn.Linear, spec: ShardSpec, group: TensorParallelGroup,
              sequence_parallel: bool) -> "RowParallelLinear":
        layer = _shell_linear(cls, linear, linear.in_features // group.size,
                              linear.out_features)
        layer.weight = split_parameter(linear.weight, spec, group)
        if linear.bias is not None:
            layer.bias = linear.bias
            if sequence_parallel:
                sum_gradient_over_group(layer.bias, group)
        layer.group, layer.sequence_parallel = group, sequence_parallel
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local_linear(x, None)
        y = (reduce_scatter_to_sequence(y, self.group) if self.sequence_parallel
             else reduce_from_group(y, self.group))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """The token embedding with its rows split: rank r holds the rows of tokens
    ``[r Vp / tp, (r + 1) Vp / tp)``, looks up the tokens in its range, writes zeros for
    the others, and the group's sum gives every token its row. In backward each rank's
    slice gets the gradient of its own tokens only (the zeros pass none)."""

    group: TensorParallelGroup
    start: int

    @classmethod
    def split(cls, embedding: nn.Embedding, spec: ShardSpec,
              group: TensorParallelGroup) -> "VocabParallelEmbedding":
        rows = embedding.num_embeddings // group.size
        layer = cls(rows, embedding.embedding_dim, device="meta")
        layer.weight = split_parameter(embedding.weight, spec, group)
        layer.group, layer.start = group, group.rank * rows
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_group(rows.masked_fill(outside[..., None], 0.0), self.group)
