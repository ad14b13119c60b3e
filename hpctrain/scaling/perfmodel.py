"""Predict a training step's time and memory from the model shape, the parallel layout
and a system's performance profile. Pure functions; every term is reported.

step = pipeline compute (m micro-batches of forward + backward on the largest stage)
     + pipeline bubble               (p-1)/(m+p-1) of the pipeline, 1F1B and GPipe;
                                     (p-1)/(v m) of the useful work, interleaved (v chunks)
     + point-to-point activations    2 transfers per micro-batch slot and chunk
     + exposed gradient reduction    what backward does not hide (``overlap``); plain
                                     data parallelism of CPU gradients uses the
                                     calibrated shared-memory allreduce where there is one
     + ZeRO parameter gathers        allgather after the step (ZeRO-1/2), per block
                                     before forward and backward (ZeRO-3, 3 Psi in all)
     + optimizer                     AdamW over the parameters this rank updates

Compute of one micro-batch is ``layers x overhead + FLOPs / rate`` (the overhead is kernel
launches and Python per block; FLOPs as ``GPT.flops_per_token``). Recomputation
(``recompute="block"``) runs each block's forward twice: its blocks cost 8 FLOPs per
weight and token instead of 6 (forward 2, backward 4, the forward again 2). A chunked head
(``loss_chunk``) computes its logits again in backward: 8 instead of 6 per head weight.
MFU still counts the model's 6N (recomputed FLOPs are not useful work). CPU ranks that
share cores (more ranks than cores on a node) run slower by the factor calibration
measured with every rank computing and synchronizing at once (else ``ranks / cores``):
compute and optimizer are scaled by it; measured collective fits already include it.

Memory per rank = model state from the ZeRO formulas (Rajbhandari et al. 2020) on the
largest stage + activations (``activation_bytes_per_layer``: Korthikanti et al., arXiv
2205.05198, for GPT-2; for Llama the tensors its block keeps) for the micro-batches a
stage holds at once, or with recomputation each layer's input and one layer's full set +
logits (one chunk of them with ``loss_chunk``) + communication buffers + the rank's base.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hpctrain.errors import UserError
from hpctrain.parallel.memory import zero_formula
from hpctrain.scaling import comm_cost
from hpctrain.scaling.models import ModelShape
from hpctrain.scaling.system_perf import SystemPerf

SCHEDULES = ("1f1b", "gpipe", "interleaved")
RECOMPUTE = ("none", "block")
MIB = 1 << 20


@dataclass(frozen=True)
class Layout:
    """One parallel configuration of a training step, with the two model options that
    change its memory and compute but not its result (recompute, loss_chunk)."""

    ranks: int
    pp: int = 1
    zero: int = 0
    micro_batches: int = 1
    global_batch: int = 1
    """Sequences per optimizer step over all ranks."""
    dtype: str = "fp32"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    bucket_mb: float = 25.0
    recompute: str = "none"
    """'block': each block keeps only its input and runs again in backward
    (``--model.recompute``)."""
    loss_chunk: int = 0
    """Tokens per chunk of the head and loss (``--model.loss_chunk``); 0: all at once."""

    @property
    def dp(self) -> int:
        return self.ranks // self.pp

    @property
    def micro_rows(self) -> int:
        return self.global_batch // (self.dp * self.micro_batches)

    def check(self, shape: ModelShape) -> None:
        """Raise ``UserError`` naming the fix for a layout the trainer would refuse."""
        if self.ranks < 1 or self.pp < 1 or self.ranks % self.pp:
            raise UserError(f"{self.ranks} rank(s) do not split into pp={self.pp} stages; "
                            "use a pp that divides the rank count")
        if self.pp > shape.n_layer * self.virtual_stages:
            raise UserError(f"pp={self.pp} is more stages than the {shape.n_layer} layers")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"zero={self.zero}: use 0, 1, 2 or 3")
        if self.pp > 1 and self.zero > 1:  # the trainer's rule (parallel/pipeline)
            raise UserError(f"pp={self.pp} combines with ZeRO stage 0 or 1, not {self.zero}: "
                            "stages 2-3 shard gradients per micro-batch")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.dtype not in ("fp32", "bf16"):
            raise UserError(f"dtype {self.dtype!r}: use fp32 or bf16")
        if self.recompute not in RECOMPUTE:
            raise UserError(f"recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if self.loss_chunk < 0:
            raise UserError(f"loss_chunk {self.loss_chunk}: use 0 (the whole head at once) "
                            "or a positive number of tokens")
        per = self.dp * self.micro_batches
        if self.global_batch < per or self.global_batch % per:
            raise UserError(f"global batch {self.global_batch} does not split into dp={self.dp}"
                            f" x micro_batches={self.micro_batches}; use a multiple of {per}")


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

    @property
    def comm_s(self) -> float:
        return self.grad_comm_s + self.gather_s + self.p2p_s

    def shares(self) -> dict:
        """The trainer's four shares: ZeRO gathers and the optimizer count as compute
        there (the trainer times only waits for reductions, the bubble and data)."""
        s = self.step_s
        return {"compute": (self.compute_s + self.optimizer_s + self.gather_s + self.p2p_s) / s,
                "comm": self.grad_comm_s / s, "bubble": self.bubble_s / s, "data": 0.0}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["shares"] = self.shares()
        return d


# ------------------------------------------------------------------ the pure terms

def bubble_fraction(p: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Idle share of a pipelined step (parallelism.md): (p-1)/(m+p-1) for GPipe and 1F1B;
    interleaved 1F1B with v chunks per rank: (p-1)/(v m) relative to the useful work,
    i.e. (p-1)/(v m + p - 1) of the whole."""
    if p <= 1:
        return 0.0
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)


def activation_bytes_per_layer(shape: ModelShape, rows: int, dtype: str,
                               flash_attention: bool) -> float:
    """Bytes one transformer layer keeps for backward, for ``rows`` sequences of s tokens.

    GPT-2: Korthikanti et al. 2022, eq. 1: s b h (34 + 5 a s / h) bytes in 16 bits, plus
    the attention-score term without flash attention; fp32 doubles it.

    Llama: the tensors ``gpt.Block`` keeps, counted one by one (``llama_bytes_per_token``).
    Korthikanti's idealised accounting of Llama's parts would give 12h + 4 h_kv + 8H in
    16 bits (41 s b h for Llama 3 8B); the block keeps more, chiefly because its RMSNorm
    computes in fp32 as Llama's reference code does (51.5 s b h in bf16)."""
    s, h, a = shape.block_size, shape.n_embd, shape.n_head
    word = 4.0 if dtype == "fp32" else 2.0
    if shape.arch == "llama":
        # without flash attention the softmax output, a s^2 words per sequence
        scores = 0.0 if flash_attention else word * a * s * s * rows
        return s * rows * llama_bytes_per_token(shape, dtype) + scores
    per = 34.0 + (0.0 if flash_attention else 5.0 * a * s / h)
    return s * rows * h * per * word / 2.0


def llama_bytes_per_token(shape: ModelShape, dtype: str) -> float:
    """Bytes a Llama block keeps per token (w bytes a word: 2 in bf16, 4 in fp32; h width,
    h_kv = n_kv_head x head size, H the SwiGLU's hidden width), with flash attention:
      each RMSNorm: its input in fp32 (4h), the normalized input and the weighted
        output in w (the QKV or the MLP projection's input)          2 x (4h + 2wh)
      the QKV projection's output, kept whole as V's storage; rotated Q and K;
        the attention output (the output projection's input)         w (3h + 3 h_kv)
      gate and up (one tensor: the SiLU and the product read it), SiLU(gate), the
        product (the down projection's input)                        w 4H
    = 8h + w (7h + 3 h_kv + 4H). Left out (1% in the tests' narrow block, less at real
    widths): the norms' and the softmax's statistics (a few numbers per token) and the
    rotary tables (per position, shared by the rows).
    ``tests/test_scaling_model.py`` counts a real block's saved tensors against it."""
    h, big = shape.n_embd, shape.ffn_hidden
    kv = shape.n_kv_head * (h // shape.n_head)
    word = 4.0 if dtype == "fp32" else 2.0
    return 8.0 * h + word * (7.0 * h + 3.0 * kv + 4.0 * big)


def activation_bytes(shape: ModelShape, layout: Layout, layers: int,
                     flash_attention: bool) -> float:
    """Activations on a stage of ``layers`` layers holding the micro-batches in flight.
    With recomputation each held micro-batch keeps every layer's input (s b h), and the
    layer running backward holds its full set again, one at a time (Chen et al. 2016)."""
    held = micro_batches_in_flight(layout.pp, layout.micro_batches, layout.schedule)
    full = activation_bytes_per_layer(shape, layout.micro_rows, layout.dtype, flash_attention)
    if layout.recompute == "none":
        return held * layers * full
    word = 4.0 if layout.dtype == "fp32" else 2.0
    inputs = shape.block_size * layout.micro_rows * shape.n_embd * word
    return held * layers * inputs + full


def logits_bytes(shape: ModelShape, layout: Layout) -> float:
    """The head's logits and their gradient in fp32 for one micro-batch (cross-entropy
    upcasts); with ``loss_chunk`` one chunk of tokens at a time, and one fp32
    log-sum-exp per token kept for backward (``model/chunked_loss.py``)."""
    tokens = layout.micro_rows * shape.block_size
    if not layout.loss_chunk:
        return 2 * 4.0 * tokens * shape.vocab_size
    return 2 * 4.0 * min(tokens, layout.loss_chunk) * shape.vocab_size + 4.0 * tokens


def micro_batches_in_flight(p: int, m: int, schedule: str) -> int:
    """Activations a stage holds at once: all m for GPipe, at most p for 1F1B (stage 0)."""
    if p <= 1:
        return 1
    return m if schedule == "gpipe" else min(p, m)


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
    cap = first_mb * MIB
    while left > 0:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = bucket_mb * MIB
    return sizes


def oversubscription(system: SystemPerf, layout: Layout, shape: ModelShape) -> float:
    """How much slower a rank computes because ranks share cores (>= 1; CPU systems only).

    Calibration measures it (every rank computing and synchronizing at once); without a
    measurement it is the ratio of ranks to cores."""
    if not system.device.startswith("cpu"):
        return 1.0
    on_node = min(system.ranks_per_node or layout.ranks, layout.ranks)
    if on_node <= system.cores():
        return 1.0
    measured = system.shared_core_slowdown(on_node, shape.key)
    return max(1.0, measured if measured else on_node / system.cores())


# ---------------------------------------------------------------------- prediction

def predict(system: SystemPerf, shape: ModelShape, layout: Layout) -> Prediction:
    layout.check(shape)
    p, m, v, dp = layout.pp, layout.micro_batches, layout.virtual_stages, layout.dp
    rows = layout.micro_rows
    tokens = rows * shape.block_size
    f = oversubscription(system, layout, shape)
    rpn = system.ranks_per_node or layout.ranks

    # Compute of one micro-batch on the largest stage; recomputation runs the forward
    # (2 of the 6 FLOPs per weight and token) once more, 8/6.
    layers = -(-shape.n_layer // p)
    again = 4.0 / 3.0 if layout.recompute == "block" else 1.0
    flops = tokens * layers * shape.layer_flops_per_token * again
    head = 4.0 / 3.0 if layout.loss_chunk else 1.0  # the chunks' logits again in backward
    flops += tokens * shape.head_flops_per_token * head  # on the last stage (or all)
    rate = system.compute_rate(shape.key, layout.dtype)
    t_micro = f * (layers * rate.layer_overhead_s * again + flops / rate.flops_per_s)
    compute = m * t_micro
    bubble = compute * bubble_fraction(p, m, layout.schedule, v) / \
        (1.0 - bubble_fraction(p, m, layout.schedule, v)) if p > 1 else 0.0

    # Activations between stages: one transfer forward and one back per micro-batch slot,
    # v times as many with interleaving. Stage neighbours are consecutive ranks.
    act_bytes = tokens * shape.n_embd * (4 if layout.dtype == "fp32" else 2)
    p2p = 0.0
    if p > 1:
        per_node = min(p, rpn)
        p2p = 2 * v * (m + p - 1) * collective(system, "p2p", 2, act_bytes, per_node)

    # Gradients reduce in fp32 buckets over the data-parallel group; dp members sit pp
    # ranks apart (grid = arange(world).reshape(dp, pp)).
    stage_params = shape.stage_params(p) if p > 1 else shape.params
    grad_bytes = 4.0 * stage_params
    param_bytes = (4.0 if layout.dtype == "fp32" else 2.0) * stage_params
    members = max(1, rpn // p)
    buckets = bucket_sizes(grad_bytes, layout.bucket_mb)
    rs = sum(collective(system, "reduce_scatter", dp, b, members) for b in buckets)
    ar = sum(collective(system, "allreduce", dp, b, members) for b in buckets)
    last = buckets[-1] if buckets else 0.0
    if layout.zero == 0 and layout.dtype == "fp32" and system.fit("shm_allreduce", dp):
        # CPU gradients on one node: the trainer sums them in shared memory.
        total = sum(collective(system, "shm_allreduce", dp, b, members) for b in buckets)
        tail = collective(system, "shm_allreduce", dp, last, members)
    elif layout.zero == 0:
        total, tail = ar, collective(system, "allreduce", dp, last, members)
    elif layout.zero == 1:  # reduce-scatter only on the last micro-batch
        total, tail = rs, collective(system, "reduce_scatter", dp, last, members)
    else:  # every micro-batch; only the last one's reduction can stick out
        total, tail = m * rs, collective(system, "reduce_scatter", dp, last, members)
    hidden = system.overlap * (2.0 / 3.0) * t_micro  # backward is ~2/3 of a micro-batch
    exposed_tail = rs if layout.zero >= 2 else total
    grad_exposed = max(tail, exposed_tail - hidden) if dp > 1 else 0.0

    gather = 0.0
    if dp > 1 and layout.zero in (1, 2):  # new parameters after the sharded update
        gather = sum(collective(system, "allgather", dp, b * param_bytes / grad_bytes, members)
                     for b in buckets)
    elif dp > 1 and layout.zero == 3:  # each block before forward and before backward
        units = layers + 1
        per_unit = collective(system, "allgather", dp, param_bytes / units, members)
        gather = 2 * m * units * per_unit * max(0.0, 1.0 - system.overlap) + per_unit

    updated = stage_params / dp if layout.zero >= 1 else stage_params
    optimizer = f * (system.optimizer_overhead_s + updated * system.optimizer_s_per_param)

    step = compute + bubble + p2p + grad_exposed + gather + optimizer
    memory, terms = predict_memory(system, shape, layout)
    tok_s = layout.global_batch * shape.block_size / step
    fl = shape.flops_per_token * tok_s / layout.ranks
    peak = system.peak_flops.get(layout.dtype)
    return Prediction(step_s=step, compute_s=compute, bubble_s=bubble, p2p_s=p2p,
                      grad_comm_s=grad_exposed, grad_comm_total_s=total if dp > 1 else 0.0,
                      gather_s=gather, optimizer_s=optimizer, oversubscription=f,
                      memory_bytes=memory, memory_terms=terms, tokens_per_s=tok_s,
                      flops_per_s_per_rank=fl, mfu=fl / peak if peak else None)


def predict_memory(system: SystemPerf, shape: ModelShape, layout: Layout) -> tuple[float, dict]:
    """Bytes on the busiest rank and the terms that make them up."""
    p, dp = layout.pp, layout.dp
    stage_params = shape.stage_params(p) if p > 1 else shape.params
    state = zero_formula(layout.zero, layout.dtype, dp) * stage_params
    layers = -(-shape.n_layer // p)
    acts = activation_bytes(shape, layout, layers, system.flash_attention)
    logits = logits_bytes(shape, layout)
    if layout.zero == 3:  # the gathered block and the prefetched next one
        buffers = 2 * (4.0 if layout.dtype == "fp32" else 2.0) * stage_params / (layers + 1)
    elif layout.dtype == "bf16" or layout.zero == 2:  # at most two fp32 staging buckets
        buffers = 2 * min(4.0 * stage_params, layout.bucket_mb * MIB)
    else:
        buffers = 0.0
    terms = {"model_state": state, "activations": acts, "logits": logits,
             "comm_buffers": buffers, "base": system.base_memory + system.memory_reserve}
    return float(sum(terms.values())), terms


def fits(system: SystemPerf, memory_bytes: float) -> bool:
    return not system.device_memory or memory_bytes <= system.device_memory


def describe(pred: Prediction) -> list[tuple[str, str]]:
    """Readable terms for ``--explain`` and reports: (name, value)."""
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    gib = lambda b: f"{b / (1 << 30):.2f} GiB"  # noqa: E731
    rows = [("compute (forward + backward, all micro-batches)", ms(pred.compute_s)),
            ("pipeline bubble", ms(pred.bubble_s)),
            ("pipeline point-to-point", ms(pred.p2p_s)),
            ("gradient reduction, exposed / total",
             f"{ms(pred.grad_comm_s)} / {ms(pred.grad_comm_total_s)}"),
            ("ZeRO parameter gathers", ms(pred.gather_s)),
            ("optimizer (AdamW on this rank's share)", ms(pred.optimizer_s)),
            ("step", ms(pred.step_s))]
    if pred.oversubscription > 1:
        rows.append(("ranks per core (compute and optimizer slowed by)",
                     f"{pred.oversubscription:.2f}"))
    rows += [(f"memory: {k}", gib(v)) for k, v in pred.memory_terms.items()]
    rows.append(("memory per rank", gib(pred.memory_bytes)))
    return rows
