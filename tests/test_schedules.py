"""Pipeline schedules as pure data, checked by simulating every stage together (no MPI)."""

import pytest

from hpctrain.parallel.pipeline import schedules as S

CASES = [(kind, p, m, v)
         for kind, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3),
                         ("zb-h1", 1))
         for p in (1, 2, 3, 4)
         for m in (1, 2, 4, 8, 16)
         if kind != "interleaved" or m % p == 0] + \
    [("zbv", p, m, 1) for p in (1, 2, 3, 4) for m in (2 * p, 2 * p + 1, 16)]


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_every_micro_batch_passes_every_chunk_once_without_deadlock(kind, p, m, v):
    sim = S.simulate(kind, p, m, v)  # raises on a deadlock, a repeat or a missing pass
    assert sim.makespan > 0


@pytest.mark.parametrize("kind,p,m,v", CASES)
def test_dependencies_hold_in_each_stage_order(kind, p, m, v):
    for s in range(p):
        actions = S.schedule(kind, p, m, s, v)
        seen = set()
        n_chunks = S.chunks_per_stage(kind, v)
        for a in actions:
            g = S.global_chunk(kind, s, a.chunk, p)
            # The input comes by message, or from this stage's own previous chunk (the
            # tip of zbv's V); the output's gradient likewise.
            prev = S.place(kind, g - 1, p) if g > 0 else None
            nxt = S.place(kind, g + 1, p) if g < p * n_chunks - 1 else None
            if a.op == S.FORWARD and prev is not None:
                assert (S.RECV_ACT, a.micro, a.chunk) in seen if prev[0] != s else \
                    (S.FORWARD, a.micro, prev[1]) in seen, f"{a} before its input"
            if a.op == S.BACKWARD:
                assert (S.FORWARD, a.micro, a.chunk) in seen, f"{a} before its forward"
                if nxt is not None:
                    assert (S.RECV_GRAD, a.micro, a.chunk) in seen if nxt[0] != s else \
                        (S.BACKWARD, a.micro, nxt[1]) in seen, f"{a} before its gradient"
            if a.op in (S.SEND_ACT,):
                assert (S.FORWARD, a.micro, a.chunk) in seen
            if a.op in (S.SEND_GRAD,):
                assert (S.BACKWARD, a.micro, a.chunk) in seen
            if a.op == S.WEIGHT:
                assert (S.BACKWARD, a.micro, a.chunk) in seen, f"{a} before its B"
            seen.add((a.op, a.micro, a.chunk))
        compute = [a for a in actions if a.op in S.COMPUTE]
        assert len(compute) == (3 if kind in S.SPLIT_BACKWARD else 2) * m * n_chunks


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
    (("zbv", 4, 6, 1), "micro_batches from 6 to 8"),
    (("zbv", 2, 4, 3), "leave --parallel.virtual_stages at 1"),
])
def test_bad_arguments_name_the_fix(args, match):
    with pytest.raises(S.ScheduleError, match=match):
        S.check_schedule_args(*args)


def test_a_broken_schedule_is_caught_as_a_deadlock(monkeypatch):
    # Stage 1 of a 2-stage 1F1B waits for a gradient before sending its activation:
    # the simulation must report the cycle instead of passing.
    original = S.schedule

    def broken(kind, p, m, s, v=1, times=S.EQUAL):
        acts = original(kind, p, m, s, v, times)
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


def _broken_zb(monkeypatch, edit, kind="zb-h1", stage=0):
    """Run the simulator on ``kind`` with ``stage``'s order changed by ``edit``."""
    original = S.schedule

    def broken(kind, p, m, s, v=1, times=S.EQUAL):
        acts = original(kind, p, m, s, v, times)
        return edit(acts) if s == stage else acts

    monkeypatch.setattr(S, "schedule", broken)
    return lambda: S.simulate(kind, 2, 4)


ZB_PLANTS = [("zb-h1", 0, 0), ("zbv", 0, 1), ("zbv", 1, 0)]
"""(schedule, stage, local chunk) whose order the planted bugs edit; for zbv both the
head's chunk and the chunk that takes the V's local handoff."""


@pytest.mark.parametrize("kind,stage,chunk", ZB_PLANTS)
def test_a_skipped_w_is_caught(monkeypatch, kind, stage, chunk):
    def drop_w1(acts):
        return [a for a in acts if not (a.op == S.WEIGHT and a.micro == 1 and a.chunk == chunk)]

    with pytest.raises(AssertionError, match="missed a pass"):
        _broken_zb(monkeypatch, drop_w1, kind, stage)()


@pytest.mark.parametrize("kind,stage,chunk", ZB_PLANTS)
def test_w_before_its_b_is_caught(monkeypatch, kind, stage, chunk):
    def swap_b0_w0(acts):
        i = next(k for k, a in enumerate(acts)
                 if a.op == S.BACKWARD and a.micro == 0 and a.chunk == chunk)
        j = next(k for k, a in enumerate(acts)
                 if a.op == S.WEIGHT and a.micro == 0 and a.chunk == chunk)
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    with pytest.raises(AssertionError, match="out of order"):
        _broken_zb(monkeypatch, swap_b0_w0, kind, stage)()


def test_zbv_second_chunk_before_the_first_on_the_tip_of_the_v_is_caught(monkeypatch):
    """The last stage hands chunk p - 1's output to chunk p with no message: only the
    simulator's order check across chunks sees a forward of chunk p run first."""
    def swap_tip(acts):
        i = next(k for k, a in enumerate(acts) if a.op == S.FORWARD and a.chunk == 0)
        j = next(k for k, a in enumerate(acts) if a.op == S.FORWARD and a.chunk == 1)
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    with pytest.raises(AssertionError, match="out of order"):
        _broken_zb(monkeypatch, swap_tip, "zbv", 1)()


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zbv_places_chunks_in_a_v_and_hands_over_locally_at_its_tip(p):
    assert [S.global_chunk("zbv", s, c, p) for s in range(p) for c in (0, 1)] == \
        [g for s in range(p) for g in (s, 2 * p - 1 - s)]
    assert all(S.place("zbv", S.global_chunk("zbv", s, c, p), p) == (s, c)
               for s in range(p) for c in (0, 1))
    last = S.schedule("zbv", p, 2 * p, p - 1)
    # The last stage sends activations only from its second chunk, receives gradients
    # only for it; the first stage receives no activation for its head chunk's loss.
    assert {a.chunk for a in last if a.op in (S.SEND_ACT, S.RECV_GRAD)} <= ({1} if p > 1 else set())
    assert {a.chunk for a in last if a.op in (S.RECV_ACT, S.SEND_GRAD)} <= ({0} if p > 1 else set())
    peers = {a.peer for s in range(p) for a in S.schedule("zbv", p, 2 * p, s) if a.peer is not None}
    assert peers <= set(range(p))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [0, 1, 8])
def test_zbv_holds_1f1b_activations_on_every_stage_and_idles_less_than_zb_h1(p, m):
    """The paper's memory term: 1F1B's p whole-stage micro-batches (2p micro-batch
    chunks) between F and B, here on every stage, and two more chunks until W. With F = B
    = W per chunk the idle share is below zb-h1's at the same work."""
    m = 2 * p + m
    sim = S.simulate("zbv", p, m, **S.unit_times(p, "zbv"))
    assert sim.peak_before_input_grad == [2 * p] * p
    assert sim.peak_in_flight == [2 * p + 2] * p
    assert sim.bubble == pytest.approx((p - 1) / (6 * m + p - 1))
    assert sim.bubble < S.predicted_bubble("zb-h1", p, m) < S.predicted_bubble("1f1b", p, m)
    # B slower than F, W cheaper: the order (built for equal times) still completes.
    slow_b = {"t_forward": 1.0, "t_backward": 1.3, "t_weight": 0.7}
    assert 0 < S.predicted_bubble("zbv", p, m, times=slow_b) < 0.5


def test_the_zbv_picture_shows_the_v():
    """Upper case: the stage's first chunk; lower case: its second. Stage 1 (the tip)
    runs F0 then f0 back to back (the local handoff)."""
    assert S.picture("zbv", 2, 4).splitlines() == [
        "stage 0: F0 F1 F2 f0 b0 f1 b1 F3 w0 w1 W0 W0 f2 b2 W1 W1 w2 f3 b3 W2 W2 w3 W3 W3",
        "stage 1: .  F0 f0 F1 f1 b0 B0 b1 B1 F2 f2 w0 F3 W0 b2 B2 f3 w1 W1 b3 B3 w2 W2 w3 W3"]


def test_zbv_tags_match_between_sender_and_receiver():
    p, m = 3, 6
    sends, recvs = set(), set()
    for s in range(p):
        for a in S.schedule("zbv", p, m, s):
            tag = S.message_tag(a.op, a.micro, a.chunk, s, p, 1, "zbv") if a.peer is not None else None
            if a.op in S.SENDS:
                sends.add((s, a.peer, tag))
            elif a.op in S.RECVS:
                recvs.add((a.peer, s, tag))
    assert sends == recvs and len(sends) == 2 * m * (2 * p - 2)
    assert max(t for _, _, t in sends) <= S.max_tag(p, m, 1, "zbv")


def test_zbv_forward_only_visits_every_chunk_in_order():
    p = 3
    seen = [S.global_chunk("zbv", s, a.chunk, p)
            for s in range(p) for a in S.forward_only(p, s, 1, "zbv") if a.op == S.FORWARD]
    assert sorted(seen) == list(range(2 * p))
