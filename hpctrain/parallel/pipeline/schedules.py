"""Pipeline schedules as pure data: which action each stage runs, in which order.

``schedule(kind, n_stages, n_micro, stage, virtual)`` lists one stage's actions for one
optimizer step: gpipe, 1f1b, interleaved, zb-h1 and zbv. Nothing here touches MPI or
torch, so ``simulate`` plays all stages together in one process and checks that every
micro-batch passes every chunk once, every receive has its send, nothing deadlocks, and
the bubble matches the formulas. With v chunks per stage, chunk g lives on stage g mod p
(Megatron-LM's interleaved layout). The schedules, their bubbles and the activations
they hold: ``docs/design/pipeline.md`` ("Schedules are data").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hpctrain.parallel.pipeline.pass_times import BACKWARD, EQUAL, FORWARD, WEIGHT, PassTimes
from hpctrain.parallel.pipeline.zb_h1 import pass_units, zb_h1_orders
from hpctrain.parallel.pipeline.zbv import (CHUNKS as ZBV_CHUNKS, v_global_chunk,
                                            v_pass_units, v_place, zbv_orders)

KINDS = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv")
SPLIT_BACKWARD = ("zb-h1", "zbv")
"""Schedules whose backward is B then W (``weight`` actions); the others' is fused."""
V_PLACED = ("zbv",)
"""Schedules whose stage s holds model chunks s and 2p - 1 - s (the others: chunk c of
stage s is model chunk c p + s)."""

RECV_ACT, SEND_ACT = "recv_act", "send_act"
RECV_GRAD, SEND_GRAD = "recv_grad", "send_grad"
COMPUTE = (FORWARD, BACKWARD, WEIGHT)
SENDS = (SEND_ACT, SEND_GRAD)
RECVS = (RECV_ACT, RECV_GRAD)


@dataclass(frozen=True)
class Action:
    op: str
    """forward, backward (B only in a split schedule), weight (W), send_act, recv_act,
    send_grad or recv_grad."""
    micro: int
    chunk: int = 0
    """This stage's local model chunk (0 unless interleaved or zbv)."""
    peer: int | None = None
    """The stage sent to or received from (None for compute)."""

    def __str__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.op}(m{self.micro},c{self.chunk}){peer}"


class ScheduleError(ValueError):
    pass


def check_schedule_args(kind: str, n_stages: int, n_micro: int, virtual: int = 1) -> None:
    """Raise ``ScheduleError`` naming the fix when the combination cannot run."""
    if kind not in KINDS:
        raise ScheduleError(f"unknown pipeline schedule {kind!r}; choose one of {', '.join(KINDS)}")
    if n_stages < 1 or n_micro < 1 or virtual < 1:
        raise ScheduleError("pipeline stages, micro-batches and virtual stages must be >= 1")
    if kind in V_PLACED and n_micro < 2 * n_stages:
        raise ScheduleError(
            f"the {kind} schedule needs at least 2 x {n_stages} stages = {2 * n_stages} "
            f"micro-batches to fill its V; raise --parallel.micro_batches from {n_micro} "
            f"to {2 * n_stages} or more, or use --parallel.schedule=zb-h1")
    if kind in V_PLACED and virtual not in (1, ZBV_CHUNKS):
        raise ScheduleError(f"the {kind} schedule places {ZBV_CHUNKS} chunks per stage "
                            "itself; leave --parallel.virtual_stages at 1")
    if kind not in ("interleaved",) + V_PLACED and virtual != 1:
        raise ScheduleError(f"--parallel.virtual_stages={virtual} needs "
                            "--parallel.schedule=interleaved")
    if kind == "interleaved" and n_micro % n_stages:
        raise ScheduleError(
            f"the interleaved schedule takes micro-batches in groups of the {n_stages} "
            f"stages; --parallel.micro_batches={n_micro} is not a multiple of {n_stages}")


def chunks_per_stage(kind: str, virtual: int = 1) -> int:
    """Model chunks each stage holds: 2 for the V-placed schedules, else ``virtual``."""
    return ZBV_CHUNKS if kind in V_PLACED else virtual


def global_chunk(kind: str, stage: int, chunk: int, n_stages: int) -> int:
    """The model chunk that ``stage`` holds as its local ``chunk``."""
    return v_global_chunk(stage, chunk, n_stages) if kind in V_PLACED else \
        chunk * n_stages + stage


def place(kind: str, g: int, n_stages: int) -> tuple[int, int]:
    """(stage, local chunk) holding model chunk ``g``."""
    return v_place(g, n_stages) if kind in V_PLACED else (g % n_stages, g // n_stages)


def local_neighbour(kind: str, stage: int, chunk: int, n_stages: int, virtual: int,
                    step: int) -> int | None:
    """The local chunk of ``stage`` that holds model chunk g + ``step`` (g: the one held as
    ``chunk``), or None when another stage holds it or there is none: where a forward
    hands its output, or a backward its input's gradient, over without a message."""
    g = global_chunk(kind, stage, chunk, n_stages) + step
    if not 0 <= g < n_stages * chunks_per_stage(kind, virtual):
        return None
    where, local = place(kind, g, n_stages)
    return local if where == stage else None


def compute_order(kind: str, n_stages: int, n_micro: int, stage: int, virtual: int = 1,
                  order_times: PassTimes = EQUAL) -> list[tuple[str, int, int]]:
    """The forward and backward passes of ``stage`` in order: (op, micro, chunk).
    ``order_times``: the pass times a zero-bubble order is built for (the others ignore
    them)."""
    check_schedule_args(kind, n_stages, n_micro, virtual)
    p, m, s = n_stages, n_micro, stage
    if kind in SPLIT_BACKWARD:
        return list(_zero_bubble_orders(kind, p, m, order_times)[s])
    if kind == "gpipe":
        return [(FORWARD, i, 0) for i in range(m)] + [(BACKWARD, i, 0) for i in range(m)]
    if kind == "1f1b" or virtual == 1:
        forwards = [(FORWARD, i, 0) for i in range(m)]
        backwards = [(BACKWARD, i, 0) for i in range(m)]
        warmup = min(p - s - 1, m)
    else:
        # Megatron-LM's order: the k-th forward of a stage is micro-batch
        # (k // (p v)) p + k % p of chunk (k // p) % v; backwards visit the chunks in
        # reverse. The deeper warm-up lets every chunk's first group get going.
        total = m * virtual
        forwards, backwards = [], []
        for k in range(total):
            group, within = divmod(k, p * virtual)
            micro = group * p + within % p
            forwards.append((FORWARD, micro, within // p))
            backwards.append((BACKWARD, micro, virtual - 1 - within // p))
        warmup = min((p - s - 1) * 2 + (virtual - 1) * p, total)
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        order += [f, b]
    order += backwards[len(forwards) - warmup:]
    return order


@functools.lru_cache(maxsize=64)
def _zero_bubble_orders(kind: str, p: int, m: int, order_times: PassTimes) -> list:
    """Every stage's zero-bubble order for ``order_times``: the one built for them, or the
    equal-time one where the simulator, with the passes taking those times, finds that
    one idles less (a greedy order for unequal times is not always better; zb-h1's at
    p >= 3 often is not). Pure and cached: every rank gets the same orders."""
    build = zbv_orders if kind in V_PLACED else zb_h1_orders
    if order_times == EQUAL:
        return build(p, m)
    candidates = [build(p, m, order_times), build(p, m)]
    times = unit_times(p, kind, order_times)

    def makespan(orders):
        plans = [_actions(kind, p, s, 1, orders[s]) for s in range(p)]
        return _simulate_plans(kind, p, m, 1, plans, **times).makespan

    return min(candidates, key=makespan)  # the timed order when both take as long


def schedule(kind: str, n_stages: int, n_micro: int, stage: int, virtual: int = 1,
             order_times: PassTimes = EQUAL) -> list[Action]:
    """Every action of ``stage`` for one step: each pass with its receive before it and
    its send after it. Neighbouring chunks on the same stage (the tip of zbv's V) hand
    over locally: no message. ``order_times`` as ``compute_order``'s."""
    return _actions(kind, n_stages, stage, virtual,
                    compute_order(kind, n_stages, n_micro, stage, virtual, order_times))


def _actions(kind: str, p: int, stage: int, virtual: int, order: list) -> list[Action]:
    """``schedule``'s actions for a stage's passes in ``order``."""
    g_last = p * chunks_per_stage(kind, virtual) - 1
    actions: list[Action] = []
    for op, micro, chunk in order:
        g = global_chunk(kind, stage, chunk, p)
        before = place(kind, g - 1, p)[0] if g > 0 else stage
        after = place(kind, g + 1, p)[0] if g < g_last else stage
        if op == FORWARD:
            if before != stage:
                actions.append(Action(RECV_ACT, micro, chunk, before))
            actions.append(Action(FORWARD, micro, chunk))
            if after != stage:
                actions.append(Action(SEND_ACT, micro, chunk, after))
        elif op == WEIGHT:
            actions.append(Action(WEIGHT, micro, chunk))
        else:
            if after != stage:
                actions.append(Action(RECV_GRAD, micro, chunk, after))
            actions.append(Action(BACKWARD, micro, chunk))
            if before != stage:
                actions.append(Action(SEND_GRAD, micro, chunk, before))
    return actions


def forward_only(n_stages: int, stage: int, virtual: int = 1,
                 kind: str = "1f1b") -> list[Action]:
    """One micro-batch forward through every chunk (evaluation): no backward, no grads."""
    order = [(FORWARD, 0, c) for c in range(chunks_per_stage(kind, virtual))]
    return _actions(kind, n_stages, stage, virtual, order)


def message_tag(op: str, micro: int, chunk: int, stage: int, n_stages: int,
                virtual: int, kind: str = "1f1b") -> int:
    """The MPI tag of the message a send or receive action moves, the same number on the
    sending and the receiving side: (direction, micro-batch, receiving global chunk)."""
    virtual = chunks_per_stage(kind, virtual)
    g = global_chunk(kind, stage, chunk, n_stages)
    if op == SEND_ACT:
        g_recv, direction = g + 1, 0
    elif op == RECV_ACT:
        g_recv, direction = g, 0
    elif op == SEND_GRAD:
        g_recv, direction = g - 1, 1
    elif op == RECV_GRAD:
        g_recv, direction = g, 1
    else:
        raise ValueError(f"{op} moves no message")
    return (micro * n_stages * virtual + g_recv) * 2 + direction


def max_tag(n_stages: int, n_micro: int, virtual: int, kind: str = "1f1b") -> int:
    virtual = chunks_per_stage(kind, virtual)
    return (n_micro * n_stages * virtual) * 2 + 1


# ----------------------------------------------------------------------- simulation

@dataclass
class Simulation:
    makespan: float
    """Time until the last stage finishes."""
    busy: list[float]
    """Compute time per stage."""
    peak_in_flight: list[int]
    """Most micro-batch chunks forwarded but not yet through their whole backward (W
    included), per stage: the graphs a stage holds at once."""
    peak_before_input_grad: list[int]
    """Most micro-batch chunks between their forward and their backward (B), per stage
    (the count the papers' activation-memory terms use; as ``peak_in_flight`` when the
    backward is fused)."""
    timeline: list[list[tuple[float, float, str]]]
    """Per stage, every pass as (start, end, label), label like ``F3`` (micro-batch 3)."""

    @property
    def bubble(self) -> float:
        """Idle share of all stages' time."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


class Deadlock(RuntimeError):
    pass


def simulate(kind: str, n_stages: int, n_micro: int, virtual: int = 1, *,
             t_forward: float = 1.0, t_backward: float = 1.0,
             t_weight: float = 0.0, order_times: PassTimes = EQUAL) -> Simulation:
    """Run every stage's actions together: compute takes time, a send delivers at once
    (MPI ``Isend``), a receive waits for its send. ``t_backward`` is B, ``t_weight`` W:
    a fused backward takes both (each time: one number, or a list with one per stage whose
    items may be lists with one per local chunk). Checks each chunk sees each micro-batch
    forward once, after the previous chunk's, then backward once, after the next chunk's,
    then (split schedules) W once; raises ``Deadlock`` if no stage can move. A micro-batch
    is in flight from its forward to its last backward part. ``order_times``: the pass
    times the zero-bubble orders are built for (``schedule``'s)."""
    plans = [schedule(kind, n_stages, n_micro, s, virtual, order_times)
             for s in range(n_stages)]
    return _simulate_plans(kind, n_stages, n_micro, virtual, plans, t_forward=t_forward,
                           t_backward=t_backward, t_weight=t_weight)


def _simulate_plans(kind: str, n_stages: int, n_micro: int, virtual: int, plans: list, *,
                    t_forward, t_backward, t_weight) -> Simulation:
    """``simulate`` with every stage's actions given."""
    p, split = n_stages, kind in SPLIT_BACKWARD
    v = chunks_per_stage(kind, virtual)
    pos, clock = [0] * p, [0.0] * p
    busy = [0.0] * p
    in_flight, peak = [0] * p, [0] * p
    before_b, peak_b = [0] * p, [0] * p
    timeline: list[list] = [[] for _ in range(p)]
    sent: dict[tuple, float] = {}  # message key -> time it was sent
    done: dict[str, set] = {FORWARD: set(), BACKWARD: set(), WEIGHT: set()}
    before = {BACKWARD: FORWARD, WEIGHT: BACKWARD}
    neighbour = {FORWARD: -1, BACKWARD: +1}  # the chunk whose same pass comes first
    f, b, w = (_per_chunk(t, p, v) for t in (t_forward, t_backward, t_weight))
    cost = [[{FORWARD: f[s][c], WEIGHT: w[s][c],
              BACKWARD: b[s][c] + (0.0 if split else w[s][c])} for c in range(v)]
            for s in range(p)]
    while any(pos[s] < len(plans[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(plans[s]):
                a = plans[s][pos[s]]
                if a.op in RECVS:
                    key = (s, a.peer, message_tag(a.op, a.micro, a.chunk, s, p, v, kind))
                    if key not in sent:
                        break
                    clock[s] = max(clock[s], sent.pop(key))
                elif a.op in SENDS:
                    sent[(a.peer, s, message_tag(a.op, a.micro, a.chunk, s, p, v, kind))] \
                        = clock[s]
                else:
                    g = global_chunk(kind, s, a.chunk, p)
                    key = (a.micro, g)
                    prior = (a.micro, g + neighbour.get(a.op, 0))
                    if key in done[a.op] or (a.op in before and key not in done[before[a.op]]) \
                            or (a.op in neighbour and 0 <= prior[1] < p * v
                                and prior not in done[a.op]):
                        raise AssertionError(f"stage {s}: {a} runs twice or out of order")
                    done[a.op].add(key)
                    if a.op == FORWARD:
                        in_flight[s] += 1
                        before_b[s] += 1
                        peak[s] = max(peak[s], in_flight[s])
                        peak_b[s] = max(peak_b[s], before_b[s])
                    if a.op == BACKWARD:
                        before_b[s] -= 1
                    if a.op == WEIGHT or (a.op == BACKWARD and not split):
                        in_flight[s] -= 1
                    dt = cost[s][a.chunk][a.op]
                    timeline[s].append((clock[s], clock[s] + dt, _label(a)))
                    clock[s] += dt
                    busy[s] += dt
                pos[s] += 1
                moved = True
        if not moved:
            stuck = {s: str(plans[s][pos[s]]) for s in range(p) if pos[s] < len(plans[s])}
            raise Deadlock(f"{kind} p={p} m={n_micro} v={v}: every stage waits: {stuck}")
    expected = {(i, g) for i in range(n_micro) for g in range(p * v)}
    if any(done[op] != expected for op in ((FORWARD, BACKWARD, WEIGHT) if split
                                           else (FORWARD, BACKWARD))):
        raise AssertionError("some micro-batch missed a pass of a chunk")
    if not split and done[WEIGHT]:
        raise AssertionError(f"{kind} runs a fused backward but lists weight passes")
    if sent:
        raise AssertionError(f"messages never received: {sorted(sent)[:3]}")
    return Simulation(makespan=max(clock), busy=busy, peak_in_flight=peak,
                      peak_before_input_grad=peak_b, timeline=timeline)


def _per_chunk(t, n_stages: int, n_chunks: int) -> list[list[float]]:
    """A time per stage and local chunk from one number, or one per stage (each a number
    or a list per chunk)."""
    per_stage = list(t) if isinstance(t, (list, tuple)) else [t] * n_stages
    return [list(x) if isinstance(x, (list, tuple)) else [x] * n_chunks for x in per_stage]


def _label(a: Action) -> str:
    """``F3`` for a pass of micro-batch 3 on local chunk 0; lower case (``f3``) on chunk 1
    and above."""
    letter = a.op[0].upper() if a.chunk == 0 else a.op[0]
    return f"{letter}{a.micro}"


def unit_times(n_stages: int, kind: str = "1f1b", pass_times: PassTimes = EQUAL) -> dict:
    """``simulate``'s times in forwards, from ``pass_times`` (default: B and W one each,
    a fused backward two), but the model's first chunk has an empty B and its W is the
    whole backward (it has no input gradient to compute). For zbv the unit is a chunk's
    forward, per chunk."""
    if kind in V_PLACED:
        units = [[v_pass_units(s, c, pass_times) for c in range(ZBV_CHUNKS)]
                 for s in range(n_stages)]
        return {name: [[u[op] for u in stage] for stage in units]
                for name, op in (("t_forward", FORWARD), ("t_backward", BACKWARD),
                                 ("t_weight", WEIGHT))}
    units = [pass_units(s, pass_times) for s in range(n_stages)]
    return {"t_forward": [u[FORWARD] for u in units],
            "t_backward": [u[BACKWARD] for u in units],
            "t_weight": [u[WEIGHT] for u in units]}


def predicted_bubble(kind: str, n_stages: int, n_micro: int, virtual: int = 1,
                     times: dict | None = None, order_times: PassTimes = EQUAL) -> float:
    """The simulator's idle share: ``times`` as ``simulate``'s keywords (default
    ``unit_times``), the order built for ``order_times``."""
    return simulate(kind, n_stages, n_micro, virtual, order_times=order_times,
                    **(times if times is not None else unit_times(n_stages, kind))).bubble


def picture(kind: str, n_stages: int, n_micro: int) -> str:
    """The schedule as text, one row per stage and one column per time unit
    (``unit_times``): F, B, W and the micro-batch (a pass of two units shows twice), ``.``
    where the stage idles."""
    sim = simulate(kind, n_stages, n_micro, **unit_times(n_stages, kind))
    rows = []
    for s, passes in enumerate(sim.timeline):
        cells, t = [], 0.0
        for start, end, label in passes:
            cells += ["."] * round(start - t) + [label] * round(end - start)
            t = end
        rows.append(cells)
    w = max(len(c) for row in rows for c in row)
    return "\n".join(f"stage {s}: " + " ".join(c.ljust(w) for c in row)
                     for s, row in enumerate(rows))
