"""``hpctrain plan``: every legal (dp, pp, tp, ZeRO, micro-batch) arrangement of a model on N
nodes that fits device memory, ranked by the performance model's step time.

Legal means what the trainer accepts (dp x pp x tp = ranks, the batch splits, pipelines
only with ZeRO 0 or 1, 1F1B or interleaved); tensor-parallel groups stay inside a node
and come with sequence parallelism. GPipe (never faster, more activations) and pipelines
with fewer micro-batches than stages (mostly bubble) are left out.
What is enumerated and why: docs/design/scaling-model.md ("``hpctrain plan``").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpctrain.errors import UserError
from hpctrain.parallel.tensor.layout import check_splittable
from hpctrain.scaling.models import ModelShape, preset_shape
from hpctrain.scaling.perfmodel import Arrangement, Prediction, describe, fits, predict
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


def arrangements(shape: ModelShape, ranks: int, global_batch: int, dtype: str,
                 max_micro_rows: int = 64, recompute: str = "none",
                 loss_chunk: int = 0, ranks_per_node: int = 1) -> list[Arrangement]:
    out = []
    for tp in tensor_parallel_sizes(shape, min(ranks_per_node, ranks)):
        out += _arrangements_of_tp(shape, ranks, tp, global_batch, dtype, max_micro_rows,
                                   recompute, loss_chunk)
    return out


def _arrangements_of_tp(shape: ModelShape, ranks: int, tp: int, global_batch: int, dtype: str,
                        max_micro_rows: int, recompute: str, loss_chunk: int) -> list[Arrangement]:
    out = []
    groups = ranks // tp
    for pp in range(1, min(groups, shape.n_layer) + 1):
        if groups % pp:
            continue
        dp = groups // pp
        if global_batch % dp:
            continue
        rows_per_rank = global_batch // dp
        schedules = [("1f1b", 1)] + ([("zb-h1", 1)] if pp > 1 else [])
        if pp > 1 and shape.n_layer % (2 * pp) == 0:
            schedules.append(("interleaved", 2))
        b = 1
        while b <= min(rows_per_rank, max_micro_rows):
            if rows_per_rank % b == 0:
                m = rows_per_rank // b
                if pp == 1 or m >= pp:
                    for zero in ((0, 1, 2, 3) if pp == 1 else (0, 1)):
                        for sched, v in schedules + ([("zbv", 1)] if pp > 1 and m >= 2 * pp
                                                     and shape.n_layer >= 2 * pp else []):
                            out.append(Arrangement(ranks=ranks, pp=pp, zero=zero, micro_batches=m,
                                                   global_batch=global_batch, dtype=dtype,
                                                   schedule=sched, virtual_stages=v,
                                                   recompute=recompute, loss_chunk=loss_chunk,
                                                   tp=tp, sequence_parallel=tp > 1))
            b *= 2
    return out


DEFAULT_BATCH = 512
"""Sequences per step when none is given (GPT-2's batch), or one per rank if more."""


def plan(*, system: str, nodes: int, model: str, global_batch: int = 0, seq_len: int = 0,
         dtype: str = "bf16", ranks_per_node: int = 0, calibration: str | None = None,
         recompute: str = "none", loss_chunk: int = 0, collectives: str = "auto") -> Plan:
    """Every legal arrangement that fits, fastest first. ``recompute``, ``loss_chunk`` and
    ``collectives`` are the trainer's ``--model.recompute``, ``--model.loss_chunk`` and
    ``--comm.collectives`` for every arrangement."""
    perf = load_perf(system, calibration, collectives)
    if nodes < 1:
        raise UserError(f"--nodes {nodes}: use at least 1")
    rpn = ranks_per_node or perf.ranks_per_node
    if rpn < 1:
        raise UserError(f"system {perf.name} has no ranks per node; pass --ranks-per-node N")
    if ranks_per_node and perf.ranks_per_node and ranks_per_node != perf.ranks_per_node:
        perf = replace(perf, ranks_per_node=ranks_per_node)
    shape = preset_shape(model, block_size=seq_len)
    ranks = nodes * rpn
    global_batch = global_batch or max(DEFAULT_BATCH, ranks)
    if global_batch < 1:
        raise UserError(f"--global-batch {global_batch}: use at least 1 sequence")
    cands = []
    for arr in arrangements(shape, ranks, global_batch, dtype, recompute=recompute,
                            loss_chunk=loss_chunk, ranks_per_node=rpn):
        cands.append(Candidate(arr, predict(perf, shape, arr)))
    if not cands:
        raise UserError(f"no arrangement splits a global batch of {global_batch} sequences over "
                        f"{ranks} ranks ({nodes} node(s) x {rpn}) with at most "
                        f"{shape.n_layer} pipeline stages; use a --global-batch that a "
                        f"divisor of {ranks} divides, e.g. {ranks}")
    ok = [c for c in cands if fits(perf, c.prediction.memory_bytes)]
    ok.sort(key=lambda c: (c.prediction.step_s, c.prediction.memory_bytes))
    smallest = min(cands, key=lambda c: c.prediction.memory_bytes)
    if not ok:
        need = smallest.prediction.memory_bytes / GiB
        chunk = min(4096, max(256, shape.block_size // 2))  # a fraction of one sequence
        options = [o for o, unset in (("--recompute block", recompute == "none"),
                                      (f"--loss-chunk {chunk}", not loss_chunk)) if unset]
        raise UserError(f"{shape.label} does not fit {perf.device} memory "
                        f"({perf.device_memory / GiB:.0f} GiB) in any arrangement on {nodes} "
                        f"node(s): the smallest needs {need:.1f} GiB per rank "
                        f"({_arrangement_text(smallest.arrangement)}); use "
                        + "".join(f"{o}, " for o in options) + "more nodes, a smaller "
                        "--global-batch or --seq-len, or a smaller model")
    return Plan(perf, shape, nodes, ranks, global_batch, tuple(ok), len(cands) - len(ok),
                smallest)


def _model_options(arr: Arrangement) -> str:
    """The model options the plan assumed, as the header says them (nothing by default)."""
    out = [f"recompute {arr.recompute}"] if arr.recompute != "none" else []
    out += [f"loss chunk {arr.loss_chunk}"] if arr.loss_chunk else []
    return "".join(f", {o}" for o in out)


def _arrangement_text(arr: Arrangement) -> str:
    pipe = f", {arr.schedule}" + (f" v={arr.virtual_stages}" if arr.virtual_stages > 1 else "")
    tensor = f" tp={arr.tp}" + (" sp" if arr.sequence_parallel else "") if arr.tp > 1 else ""
    return (f"dp={arr.dp} pp={arr.pp}{tensor} zero={arr.zero} micro-batches={arr.micro_batches} of "
            f"{arr.micro_rows}" + (pipe if arr.pp > 1 else ""))


def table(p: Plan, top: int = 12) -> str:
    s, first = p.shape, p.fitting[0].arrangement
    head = (f"{s.label}: {s.params / 1e9:.2f}B parameters, {s.n_layer} layers, width "
            f"{s.n_embd}, context {s.block_size}; {p.system.name}: {p.nodes} node(s) x "
            f"{p.ranks // p.nodes} = {p.ranks} ranks, {p.system.device_memory / GiB:.0f} GiB "
            f"per device; global batch {p.global_batch} x {s.block_size} tokens; "
            f"{first.dtype}{_model_options(first)}; gradients "
            f"through {'the GPU library' if p.system.collectives == 'xccl' else 'MPI'}")
    cols = ["#", "dp", "pp", "tp", "sched", "zero", "micro", "rows", "step s", "tok/s", "TFLOP/s",
            "MFU", "compute", "comm", "bubble", "mem GiB"]
    rows = []
    for i, c in enumerate(p.fitting[:top], 1):
        arr, q = c.arrangement, c.prediction
        sh = q.shares()
        comm = q.comm_s / q.step_s
        rows.append([str(i), str(arr.dp), str(arr.pp),
                     str(arr.tp) + ("sp" if arr.sequence_parallel else ""),
                     "-" if arr.pp == 1 else arr.schedule[:5] + (
                         f"{arr.virtual_stages}" if arr.virtual_stages > 1 else ""),
                     str(arr.zero), str(arr.micro_batches), str(arr.micro_rows),
                     f"{q.step_s:.3f}", f"{q.tokens_per_s:,.0f}",
                     f"{q.flops_per_s_per_rank / 1e12:.1f}",
                     f"{100 * q.mfu:.1f}%" if q.mfu is not None else "-",
                     f"{100 * (q.compute_s + q.optimizer_s) / q.step_s:.0f}%",
                     f"{100 * comm:.0f}%", f"{100 * sh['bubble']:.0f}%",
                     f"{q.memory_bytes / GiB:.1f}"])
    widths = [max(len(r[i]) for r in [cols] + rows) for i in range(len(cols))]
    line = lambda r: "  ".join(v.rjust(w) for v, w in zip(r, widths))  # noqa: E731
    out = [head, "", line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
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
