"""Zero-bubble orders built for given pass times (``--parallel.pass_times``): valid for
any times, the same as the equal-time order when the times are equal, never idling more
than it when they are not; the advice a run ends with, and where it is not given; the
phase clock counting W as backward. Pure data and stand-ins: no MPI."""

import random
from types import SimpleNamespace

import pytest

from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from hpctrain.parallel.pipeline import pass_time_advice as PT
from hpctrain.parallel.pipeline import schedules as S
from hpctrain.parallel.pipeline.pass_times import EQUAL, PassTimes, measured
from hpctrain.train.outputs import RunOutputs
from hpctrain.train.result import TrainResult
from hpctrain.comm.phase_clock import HOST, HostMark, PhaseClock
from tests.helpers import TIMED

TIMES = [PassTimes(1, 1, 1), PassTimes(1, 1.3, 1.05), PassTimes(1, 1.5, 0.7),
         PassTimes(1, 0.5, 2), PassTimes(2, 1, 1), PassTimes(1, 3, 0.3)]
SPLIT_CASES = [(kind, p, m) for kind in ("zb-h1", "zbv") for p in (2, 3, 4)
               for m in ((2 * p, 2 * p + 1, 16) if kind == "zbv" else (1, p, 8, 16))]


def _weights_in_order(kind, p, m, times):
    """Every stage's W passes of each local chunk, as the micro-batches they run."""
    out = {}
    for s in range(p):
        for op, micro, chunk in S.compute_order(kind, p, m, s, 1, times):
            if op == S.WEIGHT:
                out.setdefault((s, chunk), []).append(micro)
    return out


@pytest.mark.parametrize("times", TIMES, ids=str)
@pytest.mark.parametrize("kind,p,m", SPLIT_CASES)
def test_an_order_for_any_times_passes_the_simulator_and_keeps_w_in_micro_batch_order(
        kind, p, m, times):
    # simulate raises on a deadlock, a repeat, a missing pass or W before its B.
    S.simulate(kind, p, m, order_times=times, **S.unit_times(p, kind, times))
    for micros in _weights_in_order(kind, p, m, times).values():
        assert micros == sorted(micros)  # a chunk's gradients add up in one order


@pytest.mark.parametrize("kind,p,m", SPLIT_CASES)
def test_equal_times_at_any_scale_give_the_equal_time_order(kind, p, m):
    for s in range(p):
        assert S.compute_order(kind, p, m, s, 1, PassTimes(3, 3, 3)) == \
            S.compute_order(kind, p, m, s)


@pytest.mark.parametrize("times", TIMES[1:4], ids=str)
@pytest.mark.parametrize("p,m", [(2, 8), (3, 12), (4, 16)])
def test_zbv_built_for_the_real_times_idles_less(p, m, times):
    real = S.unit_times(p, "zbv", times)
    equal = S.predicted_bubble("zbv", p, m, times=real)
    timed = S.predicted_bubble("zbv", p, m, times=real, order_times=times)
    assert timed < 0.6 * equal, (timed, equal)


def _random_times(n, seed=0):
    rng = random.Random(seed)
    return [PassTimes(1, rng.uniform(0.5, 2.0), rng.uniform(0.3, 1.5)) for _ in range(n)]


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
@pytest.mark.parametrize("p", [3, 4, 5])
def test_an_order_for_the_real_times_never_idles_more_than_the_equal_time_one(kind, p):
    """A greedy order built for unequal times can idle more (zb-h1's at p >= 3 often
    does: 15.4% against 13.0% at 1 : 1.17 : 0.963, p = 4, m = 8); the equal-time order
    is kept then."""
    m = 2 * p if kind == "zbv" else 8
    for times in [PassTimes(1, 1.17, 0.963), PassTimes(1, 1.37, 0.903),
                  PassTimes(1, 1.5, 0.7), *_random_times(8, seed=p)]:
        real = S.unit_times(p, kind, times)
        equal = S.predicted_bubble(kind, p, m, times=real)
        assert S.predicted_bubble(kind, p, m, times=real, order_times=times) <= equal + 1e-12


@pytest.mark.parametrize("p", [2, 4])
def test_the_mpi_tests_timed_order_differs_from_the_equal_one(p):
    times = PassTimes(*map(float, TIMED.split(",")))
    orders = [S.compute_order("zbv", p, 2 * p, s, 1, times) for s in range(p)]
    assert orders != [S.compute_order("zbv", p, 2 * p, s) for s in range(p)]


def test_advice_suggests_the_measured_times_only_where_they_save_idle_time():
    seen = PassTimes(1, 1.5, 0.7)
    rec = PT.advice("zbv", 2, 8, EQUAL, seen)
    assert rec["suggest"] == "1,1.5,0.7" and rec["used"] == "1,1,1"
    assert rec["predicted_idle_for_measured"] < rec["predicted_idle"] - PT.IMPROVEMENT
    line = PT.advice_line("zbv", rec)
    assert "--parallel.pass_times=1,1.5,0.7 orders it for them" in line
    same = PT.advice("zbv", 2, 8, seen, seen)
    assert same["suggest"] is None
    assert "--parallel.pass_times" not in PT.advice_line("zbv", same)
    assert measured(2.0, 3.0, 1.4) == PassTimes(1.0, 1.5, 0.7)
    assert measured(2.0, 0.0, 1.4) is None  # a stage without B says nothing


@pytest.mark.parametrize("args, message", [
    (["--parallel.schedule=zbv", "--parallel.pass_times=1,2"], "three positive numbers"),
    (["--parallel.schedule=zb-h1", "--parallel.pass_times=1,0,1"], "three positive numbers"),
    (["--parallel.schedule=zbv", "--parallel.pass_times=a,b,c"], "three positive numbers"),
    (["--parallel.schedule=zbv", "--parallel.pass_times=1,nan,1"], "three positive numbers"),
    (["--parallel.schedule=zbv", "--parallel.pass_times=1,inf,1"], "three positive numbers"),
    (["--parallel.schedule=zbv", "--parallel.pass_times=1,2000,1"], "within 1000x"),
    (["--parallel.pass_times=1,1.3,1"], "leave it empty"),
    (["--parallel.schedule=zb-h1", "--parallel.virtual_stages=2"],
     "zbv places two per rank itself"),
])
def test_bad_pass_times_name_the_fix(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config("default", args)


def test_pass_times_reach_the_config_as_three_numbers():
    cfg = load_config("default", ["--parallel.schedule=zbv", "--parallel.pass_times=1,1.3,0.7"])
    assert cfg.parallel.pass_time_ratios() == (1.0, 1.3, 0.7)
    assert load_config("default").parallel.pass_time_ratios() is None
    assert load_config("default", ["--parallel.pass_times= "]).parallel.pass_time_ratios() \
        is None  # blank is empty, with any schedule
    for bad in ((1, float("nan"), 1), (1, 1, 0), (1, 1, 1e6)):
        with pytest.raises(ValueError, match="positive and within"):
            PassTimes(*bad)


def _outputs(stage=1):
    """RunOutputs with only what ``_pass_times`` reads: a zbv pp=2 run on one rank."""
    out = RunOutputs.__new__(RunOutputs)
    out.cfg = load_config("default", ["--parallel.pp=2", "--parallel.schedule=zbv",
                                      "--parallel.micro_batches=8"])
    out.grid = SimpleNamespace(pp=2, stage=stage)
    out.world = SimpleNamespace(accel=SimpleNamespace(kind="cuda"))
    out.par = SimpleNamespace(runner=SimpleNamespace(order_times=EQUAL))
    out.lines = []
    out.log = out.lines.append
    out._sum = lambda values, what: values  # one rank: the sum is its own
    return out


def _steps(n, **phases):
    return TrainResult(phases=[dict(phases) for _ in range(n)])


def test_the_end_of_run_advice_leaves_out_the_warm_up_and_the_hooks():
    # 20 steps: the first 2 are warm-up (ten times slower here); W's 0.5 s hold 0.1 s of
    # the gradient hooks' reductions: F 1, B 1.5 - 0.5 = 1, W 0.5 - 0.1 = 0.4.
    result = _steps(20, forward=1.0, backward=1.5, weight=0.5, hooks=0.1)
    for warm in result.phases[:2]:
        warm.update(forward=10.0, backward=1.0, weight=0.2, hooks=0.0)
    out = _outputs()
    rec = out._pass_times(result)
    assert rec["measured"] == "1,1,0.4" and rec["used"] == "1,1,1"
    assert out.lines == [PT.advice_line("zbv", rec)]


def test_the_phase_clock_counts_w_passes_as_backward():
    now = [0.0]

    class Mark(HostMark):  # a host mark on a clock the test moves
        def __init__(self):
            self.t = now[0]

    clock = PhaseClock(Mark, HOST)
    clock.start()
    with clock.span("backward"):
        now[0] += 0.25
    with clock.span("weight"):
        now[0] += 0.5
    now[0] += 1.0
    phases, = clock.stop()  # host marks: read at once
    assert phases["backward"] == pytest.approx(0.75) and phases["weight"] == 0.5
    # W is a part of backward: the rest of the step does not lose it twice.
    assert phases["other"] == pytest.approx(phases["step"] - 0.75) == pytest.approx(1.0)
