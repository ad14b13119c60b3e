"""The zero-bubble order ZB-H1 of F, B and W (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024), built by playing the pipeline pass by pass.

The backward is split into B (the input's gradient, which the previous stage waits for)
and W (the weights' gradients, which only the optimizer waits for; ``split_backward.py``).
Deferring W into the waits leaves (p - 1)(F + B - W) idle per stage instead of 1F1B's
(p - 1)(F + B + W), for a few more micro-batches held until W. Every rank builds the
same order from (p, m) and the pass times. The rules, the picture and the memory:
``docs/design/pipeline.md`` ("Zero bubble: B and W apart").
"""

from __future__ import annotations

from typing import Callable

from hpctrain.parallel.pipeline.pass_times import (BACKWARD, EQUAL, FORWARD, GRID, WEIGHT,
                                                   PassTimes)



def pass_units(stage: int, times: PassTimes = EQUAL) -> dict[str, float]:
    """Each pass's time on ``stage`` in forwards (with EQUAL: one each, but the first
    stage's B is empty and its W two)."""
    return {op: n / GRID for op, n in times.steps(first_chunk=stage == 0).items()}


def play(n_stages: int, passes_per_stage: int, pick: Callable, steps: Callable,
         finished: Callable) -> list[list[tuple]]:
    """Run the pipeline pass by pass: whenever stage s is free at time t, ``pick(s, t)``
    gives its next (op, micro, chunk) or None (it waits), ``steps(s, pass)`` its length,
    and ``finished(s, pass, end)`` records it. Stages are visited in order at each time,
    and a pass of no length lets its stage pick again at once; another stage sees its end
    at the next time a pass ends (the only such pass, the model's first chunk's empty B,
    is waited for by none). Returns every stage's passes in order; raises if the stages
    wait for each other with work left."""
    free_at = [0] * n_stages
    orders: list[list[tuple]] = [[] for _ in range(n_stages)]
    t = 0
    while any(len(o) < passes_per_stage for o in orders):
        for s in range(n_stages):
            while free_at[s] <= t:
                chosen = pick(s, t)
                if chosen is None:
                    break
                orders[s].append(chosen)
                free_at[s] = t + steps(s, chosen)
                finished(s, chosen, free_at[s])
        later = [f for f in free_at if f > t]
        if not later:
            raise RuntimeError(f"the order for {n_stages} stages does not finish: {orders}")
        t = min(later)
    return orders


def zb_h1_orders(n_stages: int, n_micro: int, times: PassTimes = EQUAL) -> list[list[tuple]]:
    """Every stage's (op, micro, chunk=0) in order, for one step."""
    p, m = n_stages, n_micro
    units = [times.steps(first_chunk=s == 0) for s in range(p)]
    f_done = [[None] * m for _ in range(p)]  # time each pass finished
    b_done = [[None] * m for _ in range(p)]
    next_f, next_b = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]

    def pick(s, t):
        b, f = next_b[s], next_f[s]
        if b < f and (s == p - 1 or done_by(b_done[s + 1][b], t)):
            return BACKWARD, b, 0
        if len(pending_w[s]) > p - 1:
            return WEIGHT, pending_w[s][0], 0
        if f < m and f - b < p - s and (s == 0 or done_by(f_done[s - 1][f], t)):
            return FORWARD, f, 0
        if pending_w[s]:
            return WEIGHT, pending_w[s][0], 0
        return None

    def finished(s, chosen, end):
        op, micro, _ = chosen
        if op == FORWARD:
            next_f[s] += 1
            f_done[s][micro] = end
        elif op == BACKWARD:
            next_b[s] += 1
            pending_w[s].append(micro)
            b_done[s][micro] = end
        else:
            pending_w[s].pop(0)

    return play(p, 3 * m, pick, lambda s, chosen: units[s][chosen[0]], finished)


def done_by(finished: int | None, t: int) -> bool:
    return finished is not None and finished <= t
