"""What tensor parallelism changes in a step, as the performance model counts it: the
parameters a rank holds, and the collectives of its group (Shoeybi et al. 2019,
"Megatron-LM"; Korthikanti et al. 2022 for sequence parallelism). Pure functions.

Per layer and micro-batch the group sums the (B, T, C) activation twice in forward and
twice in backward (more with recomputation), the embedding and head add two, the loss
three sums of one number per token; with sequence parallelism each sum is an all-gather
plus a reduce-scatter. All of them block the rank. Under MPI bf16 is summed in fp32.
Where each sum comes from, and the bytes: docs/design/scaling-model.md ("The performance model").
"""

from __future__ import annotations

from hpctrain.scaling.models import ModelShape

ACTIVATION_SUMS_PER_LAYER = 4
"""Two in forward, two in backward (Megatron-LM's f and g, attention and MLP)."""
RECOMPUTED_SUMS_PER_LAYER = 2
"""The forward's two again, when recomputation runs it in backward."""
OUTSIDE_SUMS = 2
"""The embedding's output in forward, the head's input gradient in backward."""
LOSS_SUMS = 3
REGATHERS_PER_LAYER = 2
"""Under sequence parallelism: each column-parallel layer's input gathered again in
backward (it keeps only its rank's tokens)."""


def whole_params_per_layer(shape: ModelShape) -> int:
    """Parameters every rank of a group holds whole: the two norms, and the output
    projections' biases (added once, after the sum)."""
    gpt = shape.gpt
    return 2 * gpt.norm_params() + (2 * shape.n_embd if shape.bias else 0)


def rank_params(shape: ModelShape, pp: int, tp: int) -> float:
    """Parameters on the busiest rank: the largest pipeline stage's, the split ones
    divided over ``tp`` (the matrices, the embedding's and head's vocabulary rows), the
    whole ones (norms, row-parallel biases, GPT-2's positions) not."""
    stage = shape.stage_params(pp) if pp > 1 else shape.params
    if tp == 1:
        return float(stage)
    layers = -(-shape.n_layer // pp)
    positions = shape.gpt.position_params()
    whole = layers * whole_params_per_layer(shape) + shape.gpt.norm_params() + positions
    return whole + (stage - whole) / tp


def activation_sums(layers: int, recompute: bool) -> int:
    """Sums of a (B, T, C) activation over the group per micro-batch on a stage of
    ``layers`` layers (the embedding's and head's counted on every stage: they sit on
    the first and last, and the busiest stage is either)."""
    per_layer = ACTIVATION_SUMS_PER_LAYER + (RECOMPUTED_SUMS_PER_LAYER if recompute else 0)
    return layers * per_layer + OUTSIDE_SUMS


def sum_word_bytes(dtype: str, collectives: str) -> float:
    """Bytes per number of a sum over the group (see the module's note)."""
    if dtype == "fp32" or collectives != "xccl":
        return 4.0
    return 2.0


def group_time(collective, *, tp: int, tokens: int, width: int, layers: int, dtype: str,
               collectives: str, recompute: bool, sp: bool) -> float:
    """Seconds of one micro-batch's tensor-parallel collectives; ``collective(kind,
    n_bytes)`` prices one collective over the group."""
    if tp <= 1:
        return 0.0
    n = tokens * width
    sum_bytes = n * sum_word_bytes(dtype, collectives)
    regather = 0.0
    if sp:
        own = n * (4.0 if dtype == "fp32" else 2.0)
        one = collective("reduce_scatter", sum_bytes) + collective("allgather", own)
        regather = layers * REGATHERS_PER_LAYER * collective("allgather", own)
    else:
        one = collective("allreduce", sum_bytes)
    loss = LOSS_SUMS * collective("allreduce", 4.0 * tokens)
    return activation_sums(layers, recompute) * one + regather + loss
