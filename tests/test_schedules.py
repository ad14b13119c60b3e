"""Pipeline schedules as pure data, checked by simulating every stage together (no MPI)."""

import pytest

from hpctrain.parallel.pipeline import schedules as S

CASES = [(kind, p, m, v)
         for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                         ("zb-h1", 1))
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
            if a.op == S.WEIGHT:
                assert (S.BACKWARD, a.micro, a.chunk) in seen, f"{a} before its B"
            seen.add((a.op, a.micro, a.chunk))
        compute = [a for a in actions if a.op in S.COMPUTE]
        assert len(compute) == (3 if kind in S.SPLIT_BACKWARD else 2) * m * v


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


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_zb_h1_holds_1f1b_activations_until_b_and_a_few_more_until_w(p, m):
    """Between F and B stage s holds 1F1B's min(p - s, m) micro-batches (the paper's
    memory term); with the W passes deferred to fill the cool-down it keeps at most
    p - 1 more graphs until their W."""
    sim = S.simulate("zb-h1", p, m, **S.unit_times(p))
    assert sim.peak_before_input_grad == [min(p - s, m) for s in range(p)]
    assert all(n <= min(2 * p - 1 - s, m) for s, n in enumerate(sim.peak_in_flight))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zb_h1_bubble_is_a_third_of_1f1bs(p, m):
    """With F = B = W the idle time is (p - 1) (F + B - W) per stage: (p - 1) / (3 m + p -
    1) of the step, against 1F1B's (p - 1) / (m + p - 1) with the same passes."""
    zb = S.predicted_bubble("zb-h1", p, m)
    assert zb == pytest.approx((p - 1) / (3 * m + p - 1))
    assert S.predicted_bubble("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    # B slower than F, W cheaper, the first stage all W: still no deadlock, still less
    # idle than 1F1B.
    slow_b = {"t_forward": 1.0, "t_backward": [0.0] + [1.3] * (p - 1),
              "t_weight": [2.0] + [0.7] * (p - 1)}
    assert S.predicted_bubble("zb-h1", p, m, times=slow_b) < \
        S.predicted_bubble("1f1b", p, m, times=slow_b)


def test_the_picture_shows_w_filling_the_cool_down():
    """The first stage's B is empty (nothing to show) and its W the whole backward."""
    text = S.picture("zb-h1", 2, 4)
    assert text.splitlines() == [
        "stage 0: F0 F1 .  F2 W0 W0 F3 W1 W1 W2 W2 W3 W3",
        "stage 1: .  F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]
    assert S.picture("1f1b", 2, 2).splitlines()[0] == "stage 0: F0 F1 .  .  B0 B0 .  B1 B1"


def _broken_zb(monkeypatch, edit):
    """Run the simulator on zb-h1 with stage 0's order changed by ``edit``."""
    original = S.schedule

    def broken(kind, p, m, s, v=1):
        acts = original(kind, p, m, s, v)
        return edit(acts) if s == 0 else acts

    monkeypatch.setattr(S, "schedule", broken)
    return lambda: S.simulate("zb-h1", 2, 4)


def test_a_skipped_w_is_caught(monkeypatch):
    def drop_w1(acts):
        return [a for a in acts if not (a.op == S.WEIGHT and a.micro == 1)]

    with pytest.raises(AssertionError, match="missed a pass"):
        _broken_zb(monkeypatch, drop_w1)()


def test_w_before_its_b_is_caught(monkeypatch):
    def swap_b0_w0(acts):
        i = next(k for k, a in enumerate(acts) if a.op == S.BACKWARD and a.micro == 0)
        j = next(k for k, a in enumerate(acts) if a.op == S.WEIGHT and a.micro == 0)
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    with pytest.raises(AssertionError, match="out of order"):
        _broken_zb(monkeypatch, swap_b0_w0)()
