"""Predict a training step's time and memory from the model shape, the parallel arrangement
and a system's performance figures. Pure functions; every term is reported.

A step is pipeline compute + bubble + point-to-point activations + the gradient
reduction backward does not hide + ZeRO parameter gathers + tensor-parallel sums +
expert-parallel all-to-alls + the optimizer. Compute is ``layers x overhead + FLOPs /
rate + traffic / bandwidth``; memory per rank is the ZeRO formulas (Rajbhandari et al.
2020) plus activations (Korthikanti et al., arXiv 2205.05198, ``activations.py``),
logits, buffers and a base.
Every term and why: docs/design/scaling-model.md ("The performance model").
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

from hpctrain.model.shape import WHOLE_HEAD, head_chunk
from hpctrain.parallel.pipeline.schedules import chunks_per_stage
from hpctrain.scaling import comm_cost, context_cost, expert_cost, tensor_cost
from hpctrain.scaling.checkpoint_cost import (CheckpointCost, Checkpointing, checkpoint_cost,
                                              describe_cost)
from hpctrain.scaling.activations import (activation_bytes_per_layer, layer_input_bytes,
                                          llama_bytes_per_token, logits_bytes,
                                          micro_batches_in_flight,
                                          selective_bytes_per_layer, word_bytes)
from hpctrain.parallel.pipeline.schedules import predicted_bubble
from hpctrain.scaling.models import ModelShape
from hpctrain.scaling.rank_memory import (activation_bytes, rank_memory_terms,
                                          recomputed_layers)
from hpctrain.scaling.system_perf import SystemPerf
from hpctrain.sizes import GiB, MiB

__all__ = ["Arrangement", "Prediction", "predict", "predict_memory", "fits", "describe",
           "bubble_fraction", "activation_bytes", "activation_bytes_per_layer",
           "llama_bytes_per_token", "selective_bytes_per_layer", "micro_batches_in_flight",
           "bucket_sizes", "recomputed_layers"]

from hpctrain.scaling.arrangement import RECOMPUTE, SCHEDULES, Arrangement  # noqa: F401


@dataclass(frozen=True)
class Prediction:
    step_s: float
    compute_s: float
    bubble_s: float
    p2p_s: float
    grad_comm_s: float
    """Gradient reduction left after backward (exposed)."""
    grad_comm_total_s: float
    """All of it, hidden or not."""
    gather_s: float
    optimizer_s: float
    oversubscription: float
    memory_bytes: float
    memory_terms: dict
    tokens_per_s: float
    flops_per_s_per_rank: float
    mfu: float | None
    tp_comm_s: float = 0.0
    """The tensor-parallel group's collectives, all exposed."""
    cp_comm_s: float = 0.0
    """The context-parallel ring's traffic that attention does not hide."""
    cp_comm_total_s: float = 0.0
    """All of the ring's traffic, hidden or not."""
    ep_comm_s: float = 0.0
    """The expert-parallel all-to-alls (tokens to their experts and back), all exposed."""
    ckpt_s: float = 0.0
    """Checkpoint stalls spread over the steps between saves (``checkpoint_cost.py``)."""
    checkpoint: CheckpointCost | None = None

    @property
    def comm_s(self) -> float:
        return (self.grad_comm_s + self.gather_s + self.p2p_s + self.tp_comm_s + self.cp_comm_s
                + self.ep_comm_s)

    def shares(self) -> dict:
        """The trainer's four shares: ZeRO gathers, tensor- and expert-parallel collectives
        and the optimizer count as compute there (the trainer times only waits for gradient
        reductions, the bubble and data); checkpoint stalls are none of them."""
        s = self.step_s
        inline = (self.compute_s + self.optimizer_s + self.gather_s + self.p2p_s
                  + self.tp_comm_s + self.cp_comm_s + self.ep_comm_s)
        return {"compute": inline / s,
                "comm": self.grad_comm_s / s, "bubble": self.bubble_s / s, "data": 0.0}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shares"] = self.shares()
        return d


# ------------------------------------------------------------------ the pure terms

def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Idle share of a pipelined step (parallelism.md): (p-1)/(m+p-1) for GPipe and 1F1B;
    interleaved 1F1B with v chunks per rank: (p-1)/(v m) relative to the useful work,
    i.e. (p-1)/(v m + p - 1) of the whole; zb-h1 (backward split into B and W, with
    F = B = W): (p-1)/(3 m + p - 1) once m >= p, fewer micro-batches simulated; zbv
    (two chunks per stage in a V, m >= 2p): (p-1)/(6 m + p - 1), half zb-h1's idle time
    (docs/design/pipeline.md)."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zbv":
        return (p - 1) / (6 * m + p - 1)
    if schedule == "zb-h1":
        if m >= p:
            return (p - 1) / (3 * m + p - 1)
        return predicted_bubble("zb-h1", p, m)
    return (p - 1) / (m + p - 1)


def collective(system: SystemPerf, kind: str, group: int, n_bytes: float,
               members_per_node: int) -> float:
    """One collective over ``group`` ranks: the measured fit where calibration has one,
    else the ring formula over the link that limits the group."""
    if group <= 1 or n_bytes <= 0:
        return 0.0
    fit = system.fit(kind, group)
    if fit is not None:
        return fit.time(n_bytes)
    rpn = system.ranks_per_node or group
    link = comm_cost.group_link(system.intra, system.inter, group_size=group,
                           members_per_node=members_per_node, ranks_per_node=rpn)
    if kind == "p2p":
        return comm_cost.p2p(n_bytes, link)
    return comm_cost.FORMULAS[kind](group, n_bytes, link)


def bucket_sizes(n_bytes: float, bucket_mb: float, first_mb: float = 1.0) -> list[float]:
    """The trainer's buckets: the first capped at 1 MiB, the rest at ``bucket_mb``."""
    sizes, left = [], n_bytes
    cap = first_mb * MiB
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = bucket_mb * MiB
    return sizes


def oversubscription(system: SystemPerf, arrangement: Arrangement, shape: ModelShape) -> float:
    """How much slower a rank computes because ranks share cores (>= 1; CPU systems only).

    Calibration measures it (every rank computing and synchronizing at once); without a
    measurement it is the ratio of ranks to cores."""
    if not system.device.startswith("cpu"):
        return 1.0
    on_node = min(system.ranks_per_node or arrangement.ranks, arrangement.ranks)
    if on_node <= system.cores():
        return 1.0
    measured = system.shared_core_slowdown(on_node, shape.key)
    return max(1.0, measured if measured else on_node / system.cores())


# ---------------------------------------------------------------------- prediction

def micro_batch_compute(system: SystemPerf, shape: ModelShape, arrangement: Arrangement,
                        layers: int) -> float:
    """Seconds of one micro-batch's forward + backward on one rank of the largest stage,
    before oversubscription: per-block overhead + FLOPs / rate + memory traffic /
    bandwidth (module docstring). A wholly recomputed layer runs its forward (2 of the 6
    FLOPs per weight and token) once more, 8/6; a selective one only its element-wise
    work, no FLOPs to count but its memory traffic again; a chunked or
    vocabulary-parallel head computes its logits again in backward, 8/6 of the head."""
    tokens = arrangement.micro_rows * shape.block_size // arrangement.cp
    again = 1.0 + recomputed_layers(arrangement, layers) / (3.0 * layers)
    chunked = head_chunk(arrangement.loss_chunk, tokens, -(-shape.vocab_size // arrangement.tp))
    head = 4.0 / 3.0 if chunked or arrangement.tp > 1 else 1.0
    flops = tokens * (shape.stage_flops_per_token(arrangement.pp) * again
                      + shape.head_flops_per_token * head) / arrangement.tp
    rate = system.compute_rate(shape.key, arrangement.dtype)
    t = layers * rate.layer_overhead_s * again + flops / rate.flops_per_s
    if system.memory_bandwidth and not system.calibrated(shape.key, arrangement.dtype):
        rows, tp, sp = arrangement.micro_rows, arrangement.tp, arrangement.sequence_parallel
        full = activation_bytes_per_layer(shape, rows, arrangement.dtype,
                                          system.flash_attention, tp, sp)
        traffic = again
        if arrangement.recompute == "selective":  # the dropped outputs written again
            dropped = 1.0 - selective_bytes_per_layer(shape, rows, arrangement.dtype, tp, sp) / full
            traffic += max(0.0, dropped) * (1.0 - recomputed_layers(arrangement, layers) / layers)
        kept = layers * traffic * full / arrangement.cp
        kept += logits_bytes(shape, tokens, WHOLE_HEAD, arrangement.tp)
        t += system.activation_passes * kept / system.memory_bandwidth
    return t


def tensor_parallel_time(system: SystemPerf, shape: ModelShape, arrangement: Arrangement,
                         layers: int) -> float:
    """One micro-batch's tensor-parallel collectives over the group of adjacent ranks."""
    members = min(arrangement.tp, system.ranks_per_node or arrangement.tp)
    return tensor_cost.group_time(
        lambda kind, n: collective(system, kind, arrangement.tp, n, members), tp=arrangement.tp,
        tokens=arrangement.micro_rows * shape.block_size // arrangement.cp, width=shape.n_embd,
        layers=layers,
        dtype=arrangement.dtype, collectives=system.collectives,
        recompute=arrangement.recompute != "none" or arrangement.recompute_every > 0,
        sp=arrangement.sequence_parallel)


def context_parallel_time(system: SystemPerf, shape: ModelShape, arrangement: Arrangement,
                          layers: int) -> tuple[float, float]:
    """One micro-batch's ring traffic (exposed, total) over the cp group, whose members
    sit tp ranks apart."""
    cp, tp = arrangement.cp, arrangement.tp
    per_node = min(cp, max(1, (system.ranks_per_node or arrangement.ranks) // tp))
    rate = system.compute_rate(shape.key, arrangement.dtype).flops_per_s
    return context_cost.ring_times(lambda n: collective(system, "p2p", cp, n, per_node), shape,
                                   arrangement.micro_rows, arrangement.dtype, cp, tp, layers,
                                   rate)


def expert_parallel_time(system: SystemPerf, shape: ModelShape, arrangement: Arrangement,
                         layers: int) -> float:
    """One micro-batch's all-to-alls over the expert-parallel group (``expert_cost.py``)."""
    rpn = system.ranks_per_node or arrangement.ranks
    members = expert_cost.ep_members_on_node(arrangement, rpn)
    exchange = lambda n: comm_cost.all_to_all(  # noqa: E731
        arrangement.ep, n, system.intra, system.inter, members_per_node=members,
        ranks_per_node=rpn)
    return expert_cost.exchange_time(exchange, shape, arrangement,
                                     recomputed_layers(arrangement, layers) / layers)


def gradient_terms(system: SystemPerf, arrangement: Arrangement, rank_params: float, layers: int,
                   t_micro: float, experts: float = 0.0) -> tuple[float, float, float]:
    """(exposed reduction, all of it, ZeRO gathers): the dense ``rank_params`` over the
    dp x cp ranks that hold the same weights (tp innermost, then cp, then pp, then dp),
    the rank's ``experts`` over the dp x cp / ep ranks that hold the same experts."""
    rpn = system.ranks_per_node or arrangement.ranks
    if arrangement.cp * arrangement.tp >= rpn:  # the cp group fills the node
        members = max(1, rpn // arrangement.tp)
    else:
        members = max(1, rpn // (arrangement.pp * arrangement.tp))
    parts = [(rank_params, arrangement.grad_group, members)]
    if experts:
        parts.append((experts, arrangement.expert_group,
                      expert_cost.expert_group_members_on_node(arrangement, rpn)))
    terms = [_reduction(system, arrangement, *part, layers) for part in parts
             if part[1] > 1 and part[0] > 0]
    if not terms:
        return 0.0, 0.0, 0.0
    total, overlapped, tail, gather = (f(t) for f, t in zip((sum, sum, max, sum), zip(*terms)))
    hidden = system.overlap * (2.0 / 3.0) * t_micro  # backward is ~2/3 of a micro-batch
    return max(tail, overlapped - hidden), total, gather


def _reduction(system: SystemPerf, arrangement: Arrangement, rank_params: float, dp: int,
               members: int, layers: int) -> tuple[float, float, float, float]:
    """One set of weights reduced over ``dp`` ranks (``members`` per node): (all of the
    reduction, the part that runs beside backward, its last bucket, ZeRO gathers)."""
    m = arrangement.micro_batches
    grad_bytes = 4.0 * rank_params
    param_bytes = word_bytes(arrangement.dtype) * rank_params
    sizes = bucket_sizes(grad_bytes, arrangement.bucket_mb)
    buckets, last = Counter(sizes), sizes[-1]  # {size: how many}, the last one
    cost = lambda kind, n: collective(system, kind, dp, n, members)  # noqa: E731

    def over_buckets(kind: str, scale: float = 1.0) -> float:
        return sum(k * cost(kind, b * scale) for b, k in buckets.items())

    rs = over_buckets("reduce_scatter")
    if arrangement.zero == 0 and arrangement.dtype == "fp32" and system.fit("shm_allreduce", dp):
        # CPU gradients on one node: the trainer sums them in shared memory.
        total = over_buckets("shm_allreduce")
        tail = cost("shm_allreduce", last)
    elif arrangement.zero == 0:
        total = over_buckets("allreduce")
        tail = cost("allreduce", last)
    elif arrangement.zero == 1:  # reduce-scatter only on the last micro-batch
        total, tail = rs, cost("reduce_scatter", last)
    else:  # every micro-batch; only the last one's reduction can stick out
        total, tail = m * rs, cost("reduce_scatter", last)
    gather = 0.0
    if arrangement.zero in (1, 2):  # new parameters after the sharded update
        gather = over_buckets("allgather", param_bytes / grad_bytes)
    elif arrangement.zero == 3:  # each block before forward and before backward
        units = layers + 1
        per_unit = cost("allgather", param_bytes / units)
        gather = 2 * m * units * per_unit * max(0.0, 1.0 - system.overlap) + per_unit
    return total, (rs if arrangement.zero >= 2 else total), tail, gather


def predict(system: SystemPerf, shape: ModelShape, arrangement: Arrangement,
            checkpointing: Checkpointing = Checkpointing()) -> Prediction:
    """The step, and with ``checkpointing.interval`` its share of the saves' stalls."""
    arrangement.check(shape)
    p, m, v = arrangement.pp, arrangement.micro_batches, arrangement.virtual_stages
    f = oversubscription(system, arrangement, shape)
    rpn = system.ranks_per_node or arrangement.ranks
    layers = -(-shape.n_layer // p)
    t_micro = f * micro_batch_compute(system, shape, arrangement, layers)
    compute = m * t_micro
    tp_comm = m * tensor_parallel_time(system, shape, arrangement, layers)
    cp_exposed, cp_total = (m * t for t in context_parallel_time(system, shape, arrangement,
                                                                  layers))
    bubble_share = bubble_fraction(p, m, arrangement.schedule, v)
    ep_comm = m * expert_parallel_time(system, shape, arrangement, layers)
    bubble = ((compute + tp_comm + cp_exposed + ep_comm) * bubble_share / (1.0 - bubble_share)
              if p > 1 else 0.0)

    # Activations between stages: one transfer forward and one back per micro-batch slot,
    # v times as many with interleaving, twice as many with zbv's V (its tip hands over
    # locally); a tp rank sends its sequence slice under sequence parallelism. Stage
    # neighbours are tp ranks apart.
    act_bytes = layer_input_bytes(shape, arrangement.micro_rows, arrangement.dtype, arrangement.tp,
                                  arrangement.sequence_parallel) / arrangement.cp
    p2p = 0.0
    if p > 1:
        per_node = min(p, max(1, rpn // (arrangement.tp * arrangement.cp)))
        chunks = chunks_per_stage(arrangement.schedule, v)
        p2p = 2 * chunks * (m + p - 1) * collective(system, "p2p", 2, act_bytes, per_node)

    dense, experts = expert_cost.rank_param_split(
        shape, arrangement, tensor_cost.rank_params(shape, p, arrangement.tp))
    grad_exposed, grad_total, gather = gradient_terms(system, arrangement, dense, layers, t_micro,
                                                      experts)
    updated = expert_cost.state_params(dense, experts, arrangement)
    optimizer = f * (system.optimizer_overhead_s + updated * system.optimizer_s_per_param)

    step = (compute + tp_comm + cp_exposed + ep_comm + bubble + p2p + grad_exposed + gather
            + optimizer)
    ckpt = None
    if checkpointing.interval:
        agree = collective(system, "allreduce", arrangement.ranks, 16.0, rpn)
        ckpt = checkpoint_cost(system, shape, arrangement, checkpointing, step, agree)
        step += ckpt.per_step_s
    memory, terms = predict_memory(system, shape, arrangement)
    tok_s = arrangement.global_batch * shape.block_size / step
    fl = shape.flops_per_token * tok_s / arrangement.ranks
    peak = system.peak_flops.get(arrangement.dtype)
    return Prediction(step_s=step, compute_s=compute, bubble_s=bubble, p2p_s=p2p,
                      grad_comm_s=grad_exposed, grad_comm_total_s=grad_total,
                      gather_s=gather, optimizer_s=optimizer, oversubscription=f,
                      memory_bytes=memory, memory_terms=terms, tokens_per_s=tok_s,
                      flops_per_s_per_rank=fl, mfu=fl / peak if peak else None,
                      tp_comm_s=tp_comm, cp_comm_s=cp_exposed, cp_comm_total_s=cp_total,
                      ep_comm_s=ep_comm,
                      ckpt_s=ckpt.per_step_s if ckpt else 0.0, checkpoint=ckpt)


def predict_memory(system: SystemPerf, shape: ModelShape,
                   arrangement: Arrangement) -> tuple[float, dict]:
    """Bytes on the busiest rank and the terms that make them up: what the step allocates
    (``rank_memory_terms``) and the system's base (the runtime's own, a reserve)."""
    terms = rank_memory_terms(shape, arrangement, system.flash_attention)
    terms["base"] = system.base_memory + system.memory_reserve
    return float(sum(terms.values())), terms


def fits(system: SystemPerf, memory_bytes: float) -> bool:
    return not system.device_memory or memory_bytes <= system.device_memory


def describe(pred: Prediction) -> list[tuple[str, str]]:
    """Readable terms for ``--explain`` and reports: (name, value)."""
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    rows = [("compute (forward + backward, all micro-batches)", ms(pred.compute_s)),
            ("pipeline bubble", ms(pred.bubble_s)),
            ("pipeline point-to-point", ms(pred.p2p_s)),
            ("tensor-parallel collectives (exposed)", ms(pred.tp_comm_s)),
            ("expert-parallel all-to-alls (exposed)", ms(pred.ep_comm_s)),
            ("context-parallel ring, exposed / total",
             f"{ms(pred.cp_comm_s)} / {ms(pred.cp_comm_total_s)}"),
            ("gradient reduction, exposed / total",
             f"{ms(pred.grad_comm_s)} / {ms(pred.grad_comm_total_s)}"),
            ("ZeRO parameter gathers", ms(pred.gather_s)),
            ("optimizer (AdamW on this rank's share)", ms(pred.optimizer_s))]
    rows += describe_cost(pred.checkpoint) if pred.checkpoint else []
    rows.append(("step", ms(pred.step_s)))
    if pred.oversubscription > 1:
        rows.append(("ranks per core (compute and optimizer slowed by)",
                     f"{pred.oversubscription:.2f}"))
    rows += [(f"memory: {k}", gib(v)) for k, v in pred.memory_terms.items()]
    rows.append(("memory per rank", gib(pred.memory_bytes)))
    return rows
