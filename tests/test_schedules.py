"""Pipeline schedules as pure data, checked by simulating every stage together (no MPI)."""

import pytest

from hpctrain.parallel.pipeline import schedules as S

CASES = [(kind, p, m, v)
         for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         for p in (1, 2, 3, 4)
         for m in (1, 2, 4, 8, 16)
         if kind != "interleaved" or m % p == 0]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_every_micro_batch_passes_every_chunk_once_without_deadlock(kind, p, m, v):
    sim = S.simulate(kind, p, m, v)  # raises on a deadlock, a repeat or a missing pass
    assert sim.makespan > 0


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_dependencies_hold_in_each_stage_order(kind, p, m, v):
    for s in range(p):
        actions = S.schedule(kind, p, m, s, v)
        seen = set()
        for a in actions:
            g = a.chunk * p + s
            if a.op == S.FORWARD and g > 0:
                assert (S.RECV_ACT, a.micro, a.chunk) in seen, f"{a} before its input"
            if a.op == S.BACKWARD:
                assert (S.FORWARD, a.micro, a.chunk) in seen, f"{a} before its forward"
                if g < p * v - 1:
                    assert (S.RECV_GRAD, a.micro, a.chunk) in seen
            if a.op in (S.SEND_ACT,):
                assert (S.FORWARD, a.micro, a.chunk) in seen
            if a.op in (S.SEND_GRAD,):
                assert (S.BACKWARD, a.micro, a.chunk) in seen
            seen.add((a.op, a.micro, a.chunk))
        compute = [a for a in actions if a.op in S.COMPUTE]
        assert len(compute) == 2 * m * v


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_1f1b_holds_at_most_min_p_minus_s_m_micro_batches(p, m):
    sim = S.simulate("1f1b", p, m)
    assert sim.peak_in_flight == [min(p - s, m) for s in range(p)]
    assert S.simulate("gpipe", p, m).peak_in_flight == [m] * p


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_bubble_matches_the_formulas(p, m):
    ideal = (p - 1) / (m + p - 1)
    assert S.simulate("gpipe", p, m).bubble == pytest.approx(ideal)
    assert S.simulate("1f1b", p, m).bubble == pytest.approx(ideal)
    for v in (2, 4):
        # Each chunk does 1/v of the stage's work.
        sim = S.simulate("interleaved", p, m, v, t_forward=1 / v, t_backward=1 / v)
        assert sim.bubble == pytest.approx((p - 1) / (v * m + p - 1))
        assert sim.bubble < ideal


def test_1f1b_warms_up_p_minus_s_minus_1_forwards():
    order = S.compute_order("1f1b", 4, 8, 1)
    assert [op for op, _, _ in order[:3]] == [S.FORWARD] * 3
    assert order[3][0] == S.BACKWARD and order[3][1] == 0


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 3, 2)])
def test_interleaved_warms_up_2_p_minus_s_minus_1_plus_v_minus_1_p_forwards(p, v, m):
    """Megatron-LM's interleaved warm-up: stage s runs w = min(2 (p - s - 1) + (v - 1) p,
    m v) forwards, then alternates forward and backward, so its first backward comes
    after w + 1 forwards (all m v when the warm-up takes them all). Fewer starve the
    later chunks; more hold activations for nothing."""
    for s in range(p):
        order = S.compute_order("interleaved", p, m, s, v)
        first_backward = next(i for i, (op, _, _) in enumerate(order) if op == S.BACKWARD)
        warmup = min(2 * (p - s - 1) + (v - 1) * p, m * v)
        assert first_backward == min(warmup + 1, m * v), (p, v, m, s)


def test_tags_match_between_sender_and_receiver():
    p, m, v = 3, 6, 2
    sends, recvs = set(), set()
    for s in range(p):
        for a in S.schedule("interleaved", p, m, s, v):
            if a.op in S.SENDS:
                sends.add((s, a.peer, S.message_tag(a.op, a.micro, a.chunk, s, p, v)))
            elif a.op in S.RECVS:
                recvs.add((a.peer, s, S.message_tag(a.op, a.micro, a.chunk, s, p, v)))
    assert sends == recvs
    tags = [t for _, _, t in sends]
    assert max(tags) <= S.max_tag(p, m, v)


def test_forward_only_visits_every_chunk_in_order():
    p, v = 3, 2
    seen = []
    for s in range(p):
        seen += [a.chunk * p + s for a in S.forward_only(p, s, v) if a.op == S.FORWARD]
    assert sorted(seen) == list(range(p * v))


@pytest.mark.parametrize("args,match", [
    (("zigzag", 2, 4, 1), "unknown pipeline schedule"),
    (("1f1b", 2, 4, 2), "interleaved"),
    (("interleaved", 4, 6, 2), "multiple of 4"),
    (("gpipe", 0, 4, 1), ">= 1"),
])
def test_bad_arguments_name_the_fix(args, match):
    with pytest.raises(S.ScheduleError, match=match):
        S.check_schedule_args(*args)


def test_a_broken_schedule_is_caught_as_a_deadlock(monkeypatch):
    # Stage 1 of a 2-stage 1F1B waits for a gradient before sending its activation:
    # the simulation must report the cycle instead of passing.
    original = S.schedule

    def broken(kind, p, m, s, v=1):
        acts = original(kind, p, m, s, v)
        if s == 0:
            first_send = next(i for i, a in enumerate(acts) if a.op == S.SEND_ACT)
            first_recv_grad = next(i for i, a in enumerate(acts) if a.op == S.RECV_GRAD)
            acts.insert(first_send, acts.pop(first_recv_grad))
        return acts

    monkeypatch.setattr(S, "schedule", broken)
    with pytest.raises(S.Deadlock):
        S.simulate("1f1b", 2, 2)
