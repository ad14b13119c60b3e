"""What one rank allocates during a training step, term by term: the model state (the
ZeRO formulas, Rajbhandari et al. 2020), the activations kept for backward (Korthikanti
et al. 2022, ``activations.py``), the head's logits and the communication buffers. This
is what a device's allocator should peak at (``torch.cuda.max_memory_allocated``:
``perf/gpu_check.py`` compares the two); ``perfmodel.predict_memory`` adds the system's
base memory on top. Pure functions of the shape and the arrangement; no torch.
"""

from __future__ import annotations

from hpctrain.parallel.memory import STAGED_AT_ONCE, zero_formula
from hpctrain.scaling import expert_cost, tensor_cost
from hpctrain.scaling.activations import (activation_bytes_per_layer, layer_input_bytes,
                                          logits_bytes, micro_batches_in_flight,
                                          selective_bytes_per_layer, word_bytes)
from hpctrain.scaling.arrangement import Arrangement
from hpctrain.scaling.models import ModelShape
from hpctrain.sizes import MiB


def recomputed_layers(arrangement: Arrangement, layers: int) -> int:
    """How many of ``layers`` layers run wholly again in backward: all with 'block', else
    every ``recompute_every``-th (a stage's share of the model's, ``layers // N``)."""
    if arrangement.recompute == "block":
        return layers
    n = arrangement.recompute_every
    return layers // n if n else 0


def activation_bytes(shape: ModelShape, arrangement: Arrangement, layers: int,
                     flash_attention: bool) -> float:
    """Activations on a stage of ``layers`` layers holding the micro-batches in flight.
    A wholly recomputed layer keeps its input (s b h) per held micro-batch, and the layer
    running backward holds its full set again, one at a time (Chen et al. 2016); a
    selective layer keeps its matmul and attention outputs (``selective_bytes_per_layer``)
    and, while its backward runs, the rest again. Context parallelism divides all of it
    by cp (each rank holds s/cp tokens of every sequence)."""
    held = micro_batches_in_flight(arrangement.pp, arrangement.micro_batches, arrangement.schedule)
    tp, sp, rows, dtype = (arrangement.tp, arrangement.sequence_parallel,
                           arrangement.micro_rows, arrangement.dtype)
    full = activation_bytes_per_layer(shape, rows, dtype, flash_attention, tp, sp)
    whole = recomputed_layers(arrangement, layers)
    kept = full
    if arrangement.recompute == "selective":
        kept = min(full, selective_bytes_per_layer(shape, rows, dtype, tp, sp))
    inputs = layer_input_bytes(shape, rows, dtype, tp, sp)
    transient = full if whole else full - kept
    return (held * (whole * inputs + (layers - whole) * kept) + transient) / arrangement.cp


def rank_memory_terms(shape: ModelShape, arrangement: Arrangement,
                      flash_attention: bool = True) -> dict[str, float]:
    """Bytes the busiest rank allocates at the step's peak, by term: the dense weights'
    state ZeRO-sharded over dp x cp (``model_state``), the rank's 1/ep of the experts'
    over dp x cp / ep (``expert_state``, MoE only), ``activations``, ``logits`` and
    ``comm_buffers``. ``flash_attention``: attention keeps no s x s scores (torch's
    fused attention on GPUs)."""
    p, dp = arrangement.pp, arrangement.grad_group
    dense, experts = expert_cost.rank_param_split(
        shape, arrangement, tensor_cost.rank_params(shape, p, arrangement.tp))
    params = dense + experts
    state = zero_formula(arrangement.zero, arrangement.dtype, dp) * dense
    expert_state = (zero_formula(arrangement.zero, arrangement.dtype, arrangement.expert_group)
                    * experts)
    layers = -(-shape.n_layer // p)
    acts = activation_bytes(shape, arrangement, layers, flash_attention)
    logits = logits_bytes(shape, arrangement.micro_rows * shape.block_size // arrangement.cp,
                          arrangement.loss_chunk, arrangement.tp)
    if arrangement.zero == 3:  # the gathered block and the prefetched next one
        buffers = 2 * word_bytes(arrangement.dtype) * params / (layers + 1)
    elif arrangement.dtype == "bf16" or arrangement.zero == 2:  # the staging pool's budget
        buffers = STAGED_AT_ONCE * min(4.0 * params, arrangement.bucket_mb * MiB)
    else:
        buffers = 0.0
    terms = {"model_state": state, "activations": acts, "logits": logits,
             "comm_buffers": buffers}
    if shape.moe_experts:
        terms = {"model_state": state, "expert_state": expert_state, **terms}
    return terms
