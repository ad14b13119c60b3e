"""The zero-bubble V schedule ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
2024; "Pipeline Parallelism with Controllable Memory", 2024).

The model is cut into 2p chunks and stage s holds chunks s and 2p - 1 - s, so the
forward runs down the stages and back up, and stage 0 holds both the embedding and the
head. The order of F, B and W is built by playing the pipeline pass by pass, as
``zb_h1.py`` does, with a budget on the chunks held between F and W; it needs m >= 2p
micro-batches. The rules, their reasons, the bubble (p - 1) / (6 m + p - 1) and the
memory held: ``docs/design/pipeline.md`` ("Zero bubble: B and W apart").
"""

from __future__ import annotations

from hpctrain.parallel.pipeline.pass_times import (BACKWARD, EQUAL, FORWARD, GRID, WEIGHT,
                                                   PassTimes)
from hpctrain.parallel.pipeline.zb_h1 import done_by, play

CHUNKS = 2
"""Model chunks per stage."""


def v_global_chunk(stage: int, chunk: int, n_stages: int) -> int:
    """The model chunk (0 .. 2p - 1) held as local ``chunk`` by ``stage``."""
    return stage if chunk == 0 else 2 * n_stages - 1 - stage


def v_place(g: int, n_stages: int) -> tuple[int, int]:
    """(stage, local chunk) holding model chunk ``g``."""
    return (g, 0) if g < n_stages else (2 * n_stages - 1 - g, 1)


def v_pass_units(stage: int, chunk: int, times: PassTimes = EQUAL) -> dict[str, float]:
    """Each pass's time of a chunk in forwards (with EQUAL: one each, but the model's
    first chunk has no input gradient, so its B is empty and its W the whole backward)."""
    return {op: n / GRID for op, n in _steps(stage, chunk, times).items()}


def _steps(stage: int, chunk: int, times: PassTimes) -> dict[str, int]:
    return times.steps(first_chunk=(stage, chunk) == (0, 0))


def zbv_orders(n_stages: int, n_micro: int, times: PassTimes = EQUAL) -> list[list[tuple]]:
    """Every stage's (op, micro, local chunk) in order, for one step."""
    p, m = n_stages, n_micro
    last = 2 * p - 1
    f_done: dict[tuple, int] = {}  # (micro, model chunk) -> time its pass finished
    b_done: dict[tuple, int] = {}
    next_f = [[0, 0] for _ in range(p)]
    next_b = [[0, 0] for _ in range(p)]
    pending_w: list[list[tuple]] = [[] for _ in range(p)]

    def pick(s, t):
        return _pick(s, p, m, t, last, next_f[s], next_b[s], pending_w[s], f_done, b_done)

    def finished(s, chosen, end):
        op, micro, c = chosen
        if op == FORWARD:
            next_f[s][c] += 1
            f_done[(micro, v_global_chunk(s, c, p))] = end
        elif op == BACKWARD:
            next_b[s][c] += 1
            pending_w[s].append((micro, c))
            b_done[(micro, v_global_chunk(s, c, p))] = end
        else:
            pending_w[s].remove((micro, c))

    return play(p, 3 * CHUNKS * m, pick,
                lambda s, chosen: _steps(s, chosen[2], times)[chosen[0]], finished)


def _pick(s, p, m, t, last, next_f, next_b, pending_w, f_done, b_done):
    """The pass stage ``s`` starts at step ``t`` (rules 1-3 of the module docstring)."""
    ready_b = [(next_b[c], c) for c in (0, 1)
               if next_b[c] < next_f[c]
               and (v_global_chunk(s, c, p) == last
                    or done_by(b_done.get((next_b[c], v_global_chunk(s, c, p) + 1)), t))]
    if ready_b:
        micro, c = min(ready_b)
        return BACKWARD, micro, c
    held = sum(next_f) - sum(next_b) + len(pending_w)  # forwarded, W not done
    for c in (1, 0):
        g = v_global_chunk(s, c, p)
        if c == 0 and next_f[0] - next_f[1] >= 2 * (p - s) - 1:
            continue  # chunk 0 is as far ahead as the V's warm-up needs
        if next_f[c] < m and held < CHUNKS * p + 2 and \
                (g == 0 or done_by(f_done.get((next_f[c], g - 1)), t)):
            return FORWARD, next_f[c], c
    if pending_w:
        micro, c = pending_w[0]
        return WEIGHT, micro, c
    return None

