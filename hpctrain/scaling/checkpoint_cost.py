"""What checkpoints cost a training step (``hpctrain plan --ckpt-interval N [--ckpt-async]``).

A save writes the optimizer's whole state once: every parameter's fp32 value and its two
Adam moments, 12 bytes a parameter whatever the training dtype (a shard stores fp32).
Under ZeRO every rank writes its shard; without it the first data-parallel replica's
ranks write (one per pipeline stage and tensor-parallel rank). The write takes

    write = max(job bytes / the file system's write rate, busiest node's bytes / a node's)

assuming the file system is otherwise idle, every writer streams at once and the node's
links (or its client) are the other limit. Before anything is written each rank copies its
state into host memory (its bytes / the device-to-host rate; all ranks at once). A
synchronous save stalls training for the copy and the whole write; an asynchronous one
(``--train.ckpt_async``) for the copy and the ranks' agreements (one small allreduce when
the save starts and one per step while it is in flight), the write going on beside
training: hidden when it ends within the ``interval`` steps before the next save, which
waits for it, else the excess counted. The stall is spread over the interval's steps.
docs/design/scaling-model.md ("Checkpoints") and docs/design/checkpoints.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.errors import UserError
from hpctrain.scaling.arrangement import Arrangement
from hpctrain.scaling.expert_cost import rank_param_split, state_params
from hpctrain.scaling.models import ModelShape
from hpctrain.scaling.tensor_cost import rank_params
from hpctrain.systems.perf import FileSystem, SystemPerf

STATE_BYTES_PER_PARAM = 12.0
"""fp32 parameter + exp_avg + exp_avg_sq: what a checkpoint stores per parameter."""


@dataclass(frozen=True)
class Checkpointing:
    """How often the run saves (``--train.ckpt_interval``; 0: not counted) and whether
    the saves are asynchronous (``--train.ckpt_async``)."""

    interval: int = 0
    asynchronous: bool = False

    def check(self) -> None:
        if self.interval < 0:
            raise UserError(f"--ckpt-interval {self.interval}: use 0 (not counted) or N >= 1 "
                            "steps between saves")
        if self.asynchronous and not self.interval:
            raise UserError("--ckpt-async needs --ckpt-interval N (the steps between saves)")


@dataclass(frozen=True)
class CheckpointCost:
    interval: int
    asynchronous: bool
    filesystem: str
    rank_bytes: float
    """The busiest rank's bytes per save."""
    node_bytes: float
    """The busiest node's."""
    job_bytes: float
    write_s: float
    copy_s: float
    """Device (or host) to host memory, on the busiest rank."""
    agree_s: float
    """The ranks' small allreduces that an asynchronous save adds."""
    stall_s: float
    """Per save: what training waits for."""
    hidden_s: float
    """Per save: the part of the write that overlaps training."""

    @property
    def per_step_s(self) -> float:
        return self.stall_s / self.interval


def writers_on_first_node(arrangement: Arrangement, ranks_per_node: int) -> int:
    """Ranks of the first node (the busiest) that write without ZeRO: data-parallel index 0
    and context-parallel index 0, ranks laid out tp innermost, then cp, then pp, then dp."""
    a = arrangement
    first = range(min(ranks_per_node, a.ranks))
    return sum(1 for r in first if r < a.pp * a.cp * a.tp and (r // a.tp) % a.cp == 0)


def checkpoint_bytes(shape: ModelShape, arrangement: Arrangement,
                     ranks_per_node: int) -> tuple[float, float, float]:
    """(busiest rank, busiest node, whole job) bytes of one save."""
    a = arrangement
    dense, experts = rank_param_split(shape, a, rank_params(shape, a.pp, a.tp))
    # with ZeRO every rank its shard of the dp x cp group's state (of the experts, the
    # dp x cp / ep ranks' holding the same); without, its 1/ep of the experts whole
    rank = STATE_BYTES_PER_PARAM * state_params(dense, experts, a)
    if a.zero >= 1:
        node = rank * min(ranks_per_node, a.ranks)
    else:
        node = rank * writers_on_first_node(a, ranks_per_node)
    return rank, node, STATE_BYTES_PER_PARAM * shape.params


def assumed_filesystem(system: SystemPerf) -> FileSystem:
    """What the model takes without ``[perf.filesystem]``: no aggregate limit, a node
    writing at its inter-node link's rate, the host copy at device memory bandwidth (or
    that link's rate where none is given)."""
    link = system.inter.bandwidth
    return FileSystem("unknown", math.inf, link, system.memory_bandwidth or link)


def checkpoint_cost(system: SystemPerf, shape: ModelShape, arrangement: Arrangement,
                    checkpointing: Checkpointing, step_s: float,
                    small_allreduce_s: float) -> CheckpointCost:
    """One save's bytes, write, stall and hidden part (module docstring); ``step_s``: a
    step without checkpoints, ``small_allreduce_s``: one allreduce of a few numbers over
    every rank."""
    fs = system.filesystem or assumed_filesystem(system)
    per_node = system.ranks_per_node or arrangement.ranks
    rank, node, job = checkpoint_bytes(shape, arrangement, per_node)
    write = max(job / fs.write_bandwidth, node / fs.node_write_bandwidth)
    copy = rank / fs.host_copy_bandwidth
    if checkpointing.asynchronous:
        window = checkpointing.interval * step_s  # the next save waits for the writer
        in_flight = min(checkpointing.interval, math.ceil(write / step_s)) if step_s > 0 else 0
        agree = small_allreduce_s * (1 + in_flight)
        excess = max(0.0, write - window)
        stall, hidden = copy + agree + excess, write - excess
    else:
        agree, stall, hidden = 0.0, copy + write, 0.0
    return CheckpointCost(checkpointing.interval, checkpointing.asynchronous, fs.name, rank,
                          node, job, write, copy, agree, stall, hidden)


def describe_cost(c: CheckpointCost) -> list[tuple[str, str]]:
    """``--explain`` rows."""
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    kind = "asynchronous" if c.asynchronous else "synchronous"
    return [(f"checkpoint bytes: job / busiest node / rank ({c.filesystem})",
             f"{gb(c.job_bytes)} / {gb(c.node_bytes)} / {gb(c.rank_bytes)}"),
            ("checkpoint write, hidden by training", f"{ms(c.write_s)}, {ms(c.hidden_s)}"),
            ("checkpoint host copy / agreements", f"{ms(c.copy_s)} / {ms(c.agree_s)}"),
            (f"checkpoint stall per save ({kind}, every {c.interval} steps)", ms(c.stall_s)),
            ("checkpoint per step", ms(c.per_step_s))]
