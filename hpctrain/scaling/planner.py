"""``hpctrain plan``: every legal (dp, pp, tp, cp, ep, ZeRO, micro-batch) arrangement of a
model on N nodes that fits device memory, ranked by the performance model's step time.

Legal means what the trainer accepts (dp x pp x tp = ranks, the batch splits, pipelines
only with ZeRO 0 or 1, 1F1B or interleaved); tensor-parallel groups stay inside a node
and come with sequence parallelism; a mixture of experts spreads its experts over every ep
dividing dp x cp and the expert count. GPipe (never faster, more activations) and pipelines
with fewer micro-batches than stages (mostly bubble) are left out.
What is enumerated and why: docs/design/scaling-model.md ("``hpctrain plan``").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.errors import UserError
from hpctrain.parallel.tensor.layout import check_splittable
from hpctrain.scaling.checkpoint_cost import Checkpointing
from hpctrain.scaling.models import ModelShape, resolve_model
from hpctrain.scaling.perfmodel import (RECOMPUTE, SCHEDULES, Arrangement, Prediction, describe,
                                        fits, predict)
from hpctrain.scaling.system_perf import SystemPerf, load_perf
from hpctrain.sizes import GiB



@dataclass(frozen=True)
class Candidate:
    arrangement: Arrangement
    prediction: Prediction


@dataclass(frozen=True)
class Plan:
    system: SystemPerf
    shape: ModelShape
    nodes: int
    ranks: int
    global_batch: int
    fitting: tuple
    """Candidates that fit, fastest first."""
    too_big: int
    """Legal arrangements left out because they do not fit device memory."""
    smallest: Candidate | None
    """The arrangement needing the least memory (to say how far off the rest is)."""
    fixed: "Fixed" = None
    checkpointing: Checkpointing = Checkpointing()


@dataclass(frozen=True)
class Fixed:
    """Parts of the layout the user fixed (``--dp --tp --pp --cp --ep --zero --micro-batch
    --schedule``); None: the planner chooses."""
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    """Sequences per micro-batch (the rest of a rank's batch is accumulated)."""
    schedule: str | None = None

    def given(self) -> dict:
        return {k: v for k, v in vars(self).items() if v is not None}

    def allows(self, **values) -> bool:
        return all(getattr(self, k) in (None, v) for k, v in values.items())

    def text(self) -> str:
        return " ".join(f"{k.replace('_', '-')}={v}" for k, v in self.given().items())


def tensor_parallel_sizes(shape: ModelShape, ranks_per_node: int) -> list[int]:
    """The tp values to plan with: divisors of the ranks per node that split the model."""
    sizes = []
    for tp in range(1, ranks_per_node + 1):
        if ranks_per_node % tp:
            continue
        try:
            check_splittable(shape.gpt, tp)
        except UserError:
            continue
        sizes.append(tp)
    return sizes


def context_parallel_sizes(shape: ModelShape, ranks: int) -> list[int]:
    """cp values above 1 that split ``ranks`` and the sequence into 2 cp chunks (none for
    a mixture of experts: the trainer does not combine them yet)."""
    if shape.moe_experts:
        return []
    return [cp for cp in range(2, ranks + 1)
            if ranks % cp == 0 and shape.block_size % (2 * cp) == 0]


def expert_parallel_sizes(shape: ModelShape, group: int) -> list[int]:
    """The ep values to plan with: common divisors of the dp x cp ranks and the experts."""
    return [ep for ep in range(1, min(group, shape.moe_experts) + 1)
            if group % ep == 0 and shape.moe_experts % ep == 0] or [1]


def arrangements(shape: ModelShape, ranks: int, global_batch: int, dtype: str,
                 max_micro_rows: int = 64, recompute: str = "none",
                 loss_chunk: int = 0, ranks_per_node: int = 1, fixed: Fixed = Fixed(),
                 cps=(1,), recompute_every: int = 0) -> list[Arrangement]:
    out = []
    for tp in tensor_parallel_sizes(shape, min(ranks_per_node, ranks)):
        for cp in cps:
            if fixed.allows(tp=tp, cp=cp) and (ranks // tp) % cp == 0:
                out += _arrangements_of(shape, ranks, tp, cp, global_batch, dtype,
                                        max_micro_rows, fixed,
                                        dict(recompute=recompute, loss_chunk=loss_chunk,
                                             recompute_every=recompute_every))
    return out


def _schedules(shape: ModelShape, pp: int, m: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zb-h1", 1)]
    if shape.n_layer % (2 * pp) == 0:
        out.append(("interleaved", 2))
    if m >= 2 * pp and shape.n_layer >= 2 * pp:
        out.append(("zbv", 1))
    return out


def _arrangements_of(shape: ModelShape, ranks: int, tp: int, cp: int, global_batch: int,
                     dtype: str, max_micro_rows: int, fixed: Fixed,
                     options: dict) -> list[Arrangement]:
    out = []
    groups = ranks // (tp * cp)
    for pp in range(1, min(groups, shape.n_layer) + 1):
        dp = groups // pp
        if groups % pp or global_batch % dp or not fixed.allows(pp=pp, dp=dp):
            continue
        rows_per_rank = global_batch // dp
        sizes = ([fixed.micro_batch] if fixed.micro_batch else
                 [b for b in (2 ** i for i in range(12)) if b <= min(rows_per_rank,
                                                                      max_micro_rows)])
        for b in sizes:
            m = rows_per_rank // b
            if rows_per_rank % b or (pp > 1 and m < pp and not fixed.micro_batch):
                continue
            eps = [ep for ep in expert_parallel_sizes(shape, dp * cp)
                   if fixed.allows(ep=ep) and (ep == 1 or tp == 1)]  # ep x tp: not yet
            for zero, ep in ((z, e) for z in ((0, 1, 2, 3) if pp == 1 else (0, 1)) for e in eps):
                gpipe = [("gpipe", 1)] if fixed.schedule == "gpipe" and pp > 1 else []
                for sched, v in _schedules(shape, pp, m) + gpipe:
                    if fixed.allows(zero=zero, schedule=sched if pp > 1 else None):
                        out.append(Arrangement(
                            ranks=ranks, pp=pp, zero=zero, micro_batches=m,
                            global_batch=global_batch, dtype=dtype, schedule=sched,
                            virtual_stages=v, tp=tp, sequence_parallel=tp > 1, cp=cp,
                            ep=ep, **options))
    return out


DEFAULT_BATCH = 512
"""Sequences per step when none is given (GPT-2's batch), or one per rank if more."""


def plan(*, system: str, nodes: int, model: str = "", global_batch: int = 0, seq_len: int = 0,
         dtype: str = "bf16", ranks_per_node: int = 0, calibration: str | None = None,
         recompute: str = "none", loss_chunk: int = 0, collectives: str = "auto",
         shape: str = "", fixed: Fixed = Fixed(), recompute_every: int = 0,
         checkpointing: Checkpointing = Checkpointing()) -> Plan:
    """Every legal arrangement that fits, fastest first. ``recompute``, ``loss_chunk`` and
    ``collectives`` are the trainer's ``--model.recompute``, ``--model.loss_chunk`` and
    ``--comm.collectives`` for every arrangement; ``fixed`` the parts of the layout the
    user chose; ``checkpointing`` the saves whose stalls every step carries a share of.
    Context parallelism (cp > 1) is planned when it is fixed, or when no arrangement
    without it fits (a sequence too long for a rank)."""
    checkpointing.check()
    perf = load_perf(system, calibration, collectives, checkpoints=checkpointing.interval > 0)
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: use at least 1")
    rpn = ranks_per_node or perf.ranks_per_node
    if rpn < 1:
        raise UserError(f"system {perf.name} has no ranks per node; pass --ranks-per-node N")
    if ranks_per_node and perf.ranks_per_node and ranks_per_node != perf.ranks_per_node:
        perf = replace(perf, ranks_per_node=ranks_per_node)
    if recompute not in RECOMPUTE:
        raise UserError(f"--recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")
    if recompute_every < 0 or (recompute_every and recompute == "block"):
        raise UserError(f"--recompute-every {recompute_every}: use 0, or N >= 1 with "
                        "--recompute none or selective (block recomputes every block)")
    model_shape = resolve_model(model, shape, seq_len)
    ranks = nodes * rpn
    global_batch = global_batch or max(DEFAULT_BATCH, ranks)
    if global_batch < 1:
        raise UserError(f"--global-batch {global_batch}: use at least 1 sequence")
    _check_fixed(fixed, model_shape, ranks, rpn, global_batch)
    args = dict(recompute=recompute, loss_chunk=loss_chunk, ranks_per_node=rpn, fixed=fixed,
                recompute_every=recompute_every)
    first = [fixed.cp] if fixed.cp else [1]
    cands = _predict(perf, model_shape, arrangements(model_shape, ranks, global_batch, dtype,
                                                      cps=first, **args), checkpointing)
    if not fixed.cp and not any(fits(perf, c.prediction.memory_bytes) for c in cands):
        cands += _predict(perf, model_shape, arrangements(
            model_shape, ranks, global_batch, dtype,
            cps=context_parallel_sizes(model_shape, ranks), **args), checkpointing)
    if not cands:
        raise UserError(_no_arrangement(fixed, model_shape, ranks, nodes, rpn, global_batch))
    ok = [c for c in cands if fits(perf, c.prediction.memory_bytes)]
    ok.sort(key=lambda c: (c.prediction.step_s, c.prediction.memory_bytes))
    smallest = min(cands, key=lambda c: c.prediction.memory_bytes)
    if not ok:
        need = smallest.prediction.memory_bytes / GiB
        chunk = min(4096, max(256, model_shape.block_size // 2))  # a fraction of a sequence
        options = [o for o, unset in (("--recompute block", recompute != "block"),
                                      (f"--loss-chunk {chunk}", not loss_chunk)) if unset]
        if fixed.given():
            options.insert(0, f"fewer fixed parts than {fixed.text()}")
        raise UserError(f"{model_shape.label} does not fit {perf.device} memory "
                        f"({perf.device_memory / GiB:.0f} GiB) in any arrangement on {nodes} "
                        f"node(s): the smallest needs {need:.1f} GiB per rank "
                        f"({_arrangement_text(smallest.arrangement)}); use "
                        + "".join(f"{o}, " for o in options) + "more nodes, a smaller "
                        "--global-batch or --seq-len, or a smaller model")
    return Plan(perf, model_shape, nodes, ranks, global_batch, tuple(ok), len(cands) - len(ok),
                smallest, fixed, checkpointing)


def _predict(perf: SystemPerf, shape: ModelShape, arrs: list[Arrangement],
             checkpointing: Checkpointing) -> list[Candidate]:
    return [Candidate(a, predict(perf, shape, a, checkpointing)) for a in arrs]


def _check_fixed(fixed: Fixed, shape: ModelShape, ranks: int, rpn: int, batch: int) -> None:
    """One message for a fixed part no arrangement can have."""
    for name, value in fixed.given().items():
        if name != "schedule" and value < (0 if name == "zero" else 1):
            raise UserError(f"--{name.replace('_', '-')} {value}: use at least "
                            f"{0 if name == 'zero' else 1}")
    if fixed.zero is not None and fixed.zero > 3:
        raise UserError(f"--zero {fixed.zero}: use 0, 1, 2 or 3")
    if fixed.schedule is not None and fixed.schedule not in SCHEDULES:
        raise UserError(f"--schedule {fixed.schedule!r}: use one of {', '.join(SCHEDULES)}")
    if fixed.tp is not None:
        if fixed.tp > rpn or rpn % fixed.tp:
            raise UserError(f"--tp {fixed.tp}: a tensor-parallel group stays inside a node; "
                            f"use a divisor of the {rpn} ranks per node")
        check_splittable(shape.gpt, fixed.tp)
    _check_fixed_ep(fixed, shape, ranks)
    if fixed.cp is not None and fixed.cp > 1 and shape.block_size % (2 * fixed.cp):
        raise UserError(f"--cp {fixed.cp}: the context {shape.block_size} does not split "
                        f"into 2 x {fixed.cp} chunks; use a cp with 2 cp dividing it")
    product = 1
    for name in ("dp", "tp", "pp", "cp"):
        product *= getattr(fixed, name) or 1
    if ranks % product:
        raise UserError(f"{fixed.text()}: dp x tp x pp x cp must divide the {ranks} ranks")
    if all(getattr(fixed, n) for n in ("dp", "tp", "pp", "cp")) and product != ranks:
        raise UserError(f"{fixed.text()}: dp x tp x pp x cp = {product}, not the {ranks} "
                        "ranks; change one, or the node count")
    if fixed.dp and batch % fixed.dp:
        raise UserError(f"--dp {fixed.dp} does not divide the global batch of {batch}; use a "
                        f"--global-batch that {fixed.dp} divides")
    if fixed.schedule is not None and fixed.pp == 1:
        raise UserError(f"--schedule {fixed.schedule} is a pipeline's: it needs --pp 2 or more")
    if fixed.schedule == "interleaved" and fixed.pp and shape.n_layer % (2 * fixed.pp):
        raise UserError(f"--schedule interleaved gives each of the {fixed.pp} stages 2 chunks: "
                        f"the {shape.n_layer} layers do not split into {2 * fixed.pp}; use "
                        "another --pp, or 1f1b, zb-h1 or zbv")
    if fixed.zero is not None and fixed.zero >= 2 and fixed.pp and fixed.pp > 1:
        raise UserError(f"--zero {fixed.zero} with --pp {fixed.pp}: pipelines run with ZeRO 0 "
                        "or 1 only")


def _check_fixed_ep(fixed: Fixed, shape: ModelShape, ranks: int) -> None:
    if not fixed.ep or fixed.ep == 1:
        return
    if not shape.moe_experts:
        raise UserError(f"--ep {fixed.ep} spreads experts over ranks, and {shape.label} has "
                        "none; drop --ep (or use --ep 1)")
    if fixed.dp and fixed.cp:
        group, what = fixed.dp * fixed.cp, f"dp x cp = {fixed.dp * fixed.cp}"
    else:  # dp x cp divides the ranks over tp x pp
        group = ranks // ((fixed.tp or 1) * (fixed.pp or 1))
        what = f"dp x cp (a divisor of {group})"
    if (fixed.tp or 1) > 1:
        raise UserError(f"--ep {fixed.ep} with --tp {fixed.tp}: expert and tensor "
                        "parallelism are not combined yet; use --tp 1 with --ep")
    if shape.moe_experts % fixed.ep or group % fixed.ep:
        raise UserError(f"--ep {fixed.ep} must divide both {what} and the "
                        f"{shape.moe_experts} experts; use a common divisor of the two")


def _no_arrangement(fixed: Fixed, shape: ModelShape, ranks: int, nodes: int, rpn: int,
                    batch: int) -> str:
    if fixed.given():
        return (f"no legal arrangement of {shape.label} on {ranks} ranks has {fixed.text()} "
                f"with a global batch of {batch} (the micro-batch must divide a rank's "
                f"sequences, a pipeline needs at least pp micro-batches and at most "
                f"{shape.n_layer} stages); fix fewer parts, or change --global-batch")
    return (f"no arrangement splits a global batch of {batch} sequences over {ranks} ranks "
            f"({nodes} node(s) x {rpn}) with at most {shape.n_layer} pipeline stages; use a "
            f"--global-batch that a divisor of {ranks} divides, e.g. {ranks}")


def _model_options(arr: Arrangement) -> str:
    """The model options the plan assumed, as the header says them (nothing by default)."""
    out = [f"recompute {arr.recompute}"] if arr.recompute != "none" else []
    out += [f"every {arr.recompute_every}th block wholly"] if arr.recompute_every else []
    out += [f"loss chunk {arr.loss_chunk}"] if arr.loss_chunk else []
    return "".join(f", {o}" for o in out)


def _checkpoint_text(p: Plan) -> str:
    c = p.checkpointing
    if not c.interval:
        return ""
    fs = p.system.filesystem
    return (f"; {'asynchronous ' if c.asynchronous else ''}checkpoints every {c.interval} "
            f"steps to {fs.name if fs else 'an unknown file system'}")


def _arrangement_text(arr: Arrangement) -> str:
    pipe = f", {arr.schedule}" + (f" v={arr.virtual_stages}" if arr.virtual_stages > 1 else "")
    tensor = f" tp={arr.tp}" + (" sp" if arr.sequence_parallel else "") if arr.tp > 1 else ""
    tensor += f" cp={arr.cp}" if arr.cp > 1 else ""
    tensor += f" ep={arr.ep}" if arr.ep > 1 else ""
    return (f"dp={arr.dp} pp={arr.pp}{tensor} zero={arr.zero} micro-batches={arr.micro_batches} of "
            f"{arr.micro_rows}" + (pipe if arr.pp > 1 else ""))


def table(p: Plan, top: int = 12) -> str:
    s, first = p.shape, p.fitting[0].arrangement
    head = (f"{s.label}: {s.params / 1e9:.2f}B parameters, {s.n_layer} layers, width "
            f"{s.n_embd}, context {s.block_size}; {p.system.name}: {p.nodes} node(s) x "
            f"{p.ranks // p.nodes} = {p.ranks} ranks, {p.system.device_memory / GiB:.0f} GiB "
            f"per device; global batch {p.global_batch} x {s.block_size} tokens; "
            f"{first.dtype}{_model_options(first)}; gradients "
            f"through {'the GPU library' if p.system.collectives == 'xccl' else 'MPI'}"
            + (f"; fixed: {p.fixed.text()}" if p.fixed and p.fixed.given() else "")
            + _checkpoint_text(p))
    ckpt = bool(p.checkpointing.interval)
    moe = bool(s.moe_experts)
    cols = ["#", "dp", "pp", "tp", "cp"] + (["ep"] if moe else []) + [
            "sched", "zero", "micro", "rows", "step s", "job tok/s", "GPU tok/s", "GPU TFLOP/s",
            "MFU", "compute", "comm", "bubble"] + (
            ["ckpt"] if ckpt else []) + ["mem GiB"] + (["experts GiB"] if moe else [])
    rows = []
    for i, c in enumerate(p.fitting[:top], 1):
        arr, q = c.arrangement, c.prediction
        sh = q.shares()
        comm = q.comm_s / q.step_s
        rows.append([str(i), str(arr.dp), str(arr.pp),
                     str(arr.tp) + ("sp" if arr.sequence_parallel else ""), str(arr.cp)]
                    + ([str(arr.ep)] if moe else [])
                    + ["-" if arr.pp == 1 else arr.schedule[:5] + (
                         f"{arr.virtual_stages}" if arr.virtual_stages > 1 else ""),
                     str(arr.zero), str(arr.micro_batches), str(arr.micro_rows),
                     f"{q.step_s:.3f}", f"{q.tokens_per_s:,.0f}",
                     f"{q.tokens_per_s / arr.ranks:,.0f}",
                     f"{q.flops_per_s_per_rank / 1e12:.1f}",
                     f"{100 * q.mfu:.1f}%" if q.mfu is not None else "-",
                     f"{100 * (q.compute_s + q.optimizer_s) / q.step_s:.0f}%",
                     f"{100 * comm:.0f}%", f"{100 * sh['bubble']:.0f}%"]
                    + ([f"{100 * q.ckpt_s / q.step_s:.1f}%"] if ckpt else [])
                    + [f"{q.memory_bytes / GiB:.1f}"]
                    + ([f"{q.memory_terms['expert_state'] / GiB:.1f}"] if moe else []))
    widths = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]
    line = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths))  # noqa: E731
    out = [head, "", line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out.append("job tok/s: tokens per second of the whole job; GPU tok/s and GPU TFLOP/s: "
               "per rank (one GPU or tile); MFU: of the device's peak."
               + (" ckpt: the step's share of checkpoint stalls." if ckpt else "")
               + (" experts GiB: the rank's 1/ep of the experts' weights, gradients and "
                  "optimizer state (in mem GiB)." if moe else ""))
    shown = min(top, len(p.fitting))
    out.append("")
    out.append(f"{len(p.fitting)} arrangement(s) fit ({shown} shown, fastest first); "
               f"{p.too_big} more do not fit device memory. Step times are predictions "
               f"from the {p.system.name} system ({p.system.source}"
               + (f", calibration {p.system.calibration}" if p.system.calibration else "")
               + "); --explain N shows the terms.")
    return "\n".join(out)


def explain(p: Plan, rank: int = 1) -> str:
    if not 1 <= rank <= len(p.fitting):
        raise UserError(f"--explain {rank}: the plan has {len(p.fitting)} arrangement(s)")
    c = p.fitting[rank - 1]
    rows = describe(c.prediction)
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"#{rank}: {_arrangement_text(c.arrangement)}"] +
                     [f"  {k.ljust(width)}  {v}" for k, v in rows])
