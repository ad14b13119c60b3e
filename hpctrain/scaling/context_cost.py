"""What context parallelism (ring attention) adds to a step, as the performance model
counts it. Pure functions.

Each of ``cp`` ranks holds two load-balanced chunks of every sequence (s / cp tokens):
its activations, logits and matrix-multiply FLOPs are 1/cp of the whole sequence's.
Attention needs every earlier key and value: per layer and micro-batch, forward passes
each rank's k and v blocks (2 x s/cp x h_kv words per row) around the ring cp - 1
times; backward passes k and v again with their gradients (twice the bytes). Each ring
step runs beside the attention of the block already in hand, so only what exceeds the
layer's attention compute is exposed. Gradients are then reduced over dp x cp ranks
(every cp rank holds the whole layer's weights). Where the terms come from:
docs/design/scaling-model.md ("Context parallelism").
"""

from __future__ import annotations

from hpctrain.scaling.activations import word_bytes
from hpctrain.scaling.models import ModelShape

RING_PASSES = 3
"""k, v once in forward; k, v and their gradients (twice the bytes) in backward."""


def kv_block_bytes(shape: ModelShape, rows: int, dtype: str, cp: int, tp: int = 1) -> float:
    """Bytes of one rank's k and v blocks for ``rows`` sequences: 2 x s/cp x h_kv words,
    the key/value heads split over ``tp``."""
    kv = shape.n_kv_head * (shape.n_embd // shape.n_head)
    return 2.0 * rows * (shape.block_size / cp) * kv * word_bytes(dtype) / tp


def attention_flops_per_layer(shape: ModelShape, rows: int, cp: int, tp: int = 1) -> float:
    """Forward + backward FLOPs of one layer's attention scores and weighted sum on one
    rank (12 h s per token, the part of ``layer_flops_per_token`` that is not weights)."""
    tokens = rows * shape.block_size / cp
    return 12.0 * shape.n_embd * shape.block_size * tokens / tp


def ring_times(step_time, shape: ModelShape, rows: int, dtype: str, cp: int, tp: int,
               layers: int, flops_per_s: float) -> tuple[float, float]:
    """(exposed, total) seconds of one micro-batch's ring traffic on a stage of
    ``layers`` layers; ``step_time(n_bytes)`` prices one point-to-point step of the ring."""
    if cp <= 1:
        return 0.0, 0.0
    block = kv_block_bytes(shape, rows, dtype, cp, tp)
    per_layer = (cp - 1) * (step_time(block) + step_time(2.0 * block))
    attention = attention_flops_per_layer(shape, rows, cp, tp) / flops_per_s
    return layers * max(0.0, per_layer - attention), layers * per_layer
