"""The zero-bubble order ZB-H1 of F, B and W (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024), built by playing the pipeline in unit time steps.

The backward is split into B (the input's gradient, which the previous stage waits for)
and W (the weights' gradients, which only the optimizer waits for;
``split_backward.py``). With F = B = W = one time unit, every stage at every step takes
the first of these it can run:

1. B of its oldest forwarded micro-batch, once the gradient from the next stage is there
   (it unblocks the previous stage);
2. W of its oldest B-done micro-batch, if more than p - 1 are waiting for theirs;
3. F of its next micro-batch, once the activation is there and fewer than p - s
   micro-batches are between their F and their B (1F1B's budget on stage s);
4. W of its oldest B-done micro-batch (filling what would be idle time).

Deferring W lets the B passes of the cool-down run back to back down the pipeline, and
the deferred W passes fill the waits between them: the idle time left is (p - 1)
(F + B - W) per stage instead of 1F1B's (p - 1) (F + B + W), a third with equal times.
The price: a micro-batch whose W is deferred keeps its graph (here the whole of it) until
W, so stage s holds up to p - s micro-batches between F and B, as 1F1B does, and a few
more between F and W (the simulator's ``peak_in_flight`` counts those).

The order is a property of (p, m) only; a stage runs it whatever the real times are (a
slower pass delays, never deadlocks: the order was a valid execution of the whole
pipeline, and the simulator in ``schedules.py`` checks it again).
"""

from __future__ import annotations

FORWARD, BACKWARD, WEIGHT = "forward", "backward", "weight"


def pass_units(stage: int) -> dict[str, int]:
    """Time units of each pass on ``stage``: one each, but the first stage has no input
    gradient to compute, so its B is empty and its W is the whole backward."""
    return {FORWARD: 1, BACKWARD: 0, WEIGHT: 2} if stage == 0 else \
        {FORWARD: 1, BACKWARD: 1, WEIGHT: 1}


def zb_h1_orders(n_stages: int, n_micro: int) -> list[list[tuple]]:
    """Every stage's (op, micro, chunk=0) in order, for one step."""
    p, m = n_stages, n_micro
    units = [pass_units(s) for s in range(p)]
    f_done = [[None] * m for _ in range(p)]  # time step each pass finished
    b_done = [[None] * m for _ in range(p)]
    next_f, next_b = [0] * p, [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    free_at = [0] * p
    orders: list[list[tuple]] = [[] for _ in range(p)]
    t = 0
    while any(len(o) < 3 * m for o in orders):
        for s in range(p):
            while free_at[s] <= t:  # a pass of no time lets the stage choose again
                b, f = next_b[s], next_f[s]
                if b < f and (s == p - 1 or done_by(b_done[s + 1][b], t)):
                    op, micro = BACKWARD, b
                    next_b[s] += 1
                    pending_w[s].append(b)
                elif len(pending_w[s]) > p - 1:
                    op, micro = WEIGHT, pending_w[s].pop(0)
                elif f < m and f - b < p - s and (s == 0 or done_by(f_done[s - 1][f], t)):
                    op, micro = FORWARD, f
                    next_f[s] += 1
                elif pending_w[s]:
                    op, micro = WEIGHT, pending_w[s].pop(0)
                else:
                    break
                orders[s].append((op, micro, 0))
                free_at[s] = t + units[s][op]
                if op != WEIGHT:  # only F and B are waited for across stages
                    (f_done if op == FORWARD else b_done)[s][micro] = free_at[s]
        t += 1
    return orders


def done_by(finished: int | None, t: int) -> bool:
    return finished is not None and finished <= t
