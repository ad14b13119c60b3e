"""The phase clock (``comm/phase_clock.py``) and ``--train.profile`` (``train/trace.py``).

On the fake device each phase is a span between two of its events, read only once the
host has waited for the step's last one: a run there proves every phase is bracketed,
the events are read after the step's one wait (no device sync) and the phases add up to
the step. On the CPU the clock is the host's. ``--train.profile`` writes a trace per rank
that ``hpctrain report`` reads (``tests/test_trace_summary.py`` checks its arithmetic)."""

from __future__ import annotations

import json

import pytest
from mpi4py import MPI

from hpctrain.comm.fake_device import FakeAccelerator
from hpctrain.comm.phase_clock import DEVICE_EVENTS, HOST, PARTS_OF_BACKWARD, PHASES
from hpctrain.comm.world import World
from hpctrain.errors import ConfigError, UserError
from hpctrain.report.trace_summary import summarize_run_traces
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

SPANS = ("data", "forward", "backward", "optimizer")
"""Phases every step of a single-rank run spends time in."""


def _fake_run(cfg):
    world = World.create(MPI.COMM_SELF, device="fake", gpu_aware="no")
    trainer = Trainer(cfg, world, verbose=False)
    result = trainer.fit()
    return world, result


@pytest.fixture(scope="module")
def fake_run(dataset_path, tmp_path_factory):
    """Four steps of two micro-batches on the fake device, steps 2-3 traced."""
    out = tmp_path_factory.mktemp("fake_run")
    cfg = tiny_config(dataset_path, out, **{"train.max_iters": 4, "train.device": "fake",
                                            "parallel.micro_batches": 2,
                                            "train.profile": "2-3"})
    world, result = _fake_run(cfg)
    return out, world, result


def _check_adds_up(step: dict) -> None:
    beside = sum(v for k, v in step.items() if k not in (*PARTS_OF_BACKWARD, "step"))
    assert beside == pytest.approx(step["step"], rel=1e-9, abs=1e-12)
    assert all(v >= 0 for v in step.values()), step
    assert step["hooks"] <= step["backward"] and step["weight"] <= step["backward"]


def test_fake_device_phases_come_from_its_events_and_add_up(fake_run):
    out, world, result = fake_run
    assert world.accel.clock.name == DEVICE_EVENTS
    assert len(result.phases) == 4
    for step in result.phases:
        assert set(step) == {*PHASES, "weight", "step"}
        _check_adds_up(step)
        assert min(step[k] for k in SPANS) > 0
    # The events were read after the step's own waits: not one whole-device sync.
    assert world.accel.stats.device_syncs == 0
    timing = json.loads((out / "summary.json").read_text())["timing"]
    assert timing["clock"] == DEVICE_EVENTS
    assert set(timing["phases_ms"]) == {*PHASES, "step"}


def test_a_fake_event_is_read_only_after_the_host_waited_for_it():
    accel = FakeAccelerator()
    clock = accel.clock
    clock.start()
    with clock.span("forward") as span:
        pass
    with pytest.raises(RuntimeError, match="before the host waited"):
        span.begin.seconds_to(span.end)
    # The step's last event has not passed: it is read at the next step's end, after
    # that step's own events were queued, never by waiting for it at its own end.
    assert clock.stop() == []
    clock.start()
    with clock.span("backward"):
        pass
    first, = clock.stop()  # waits for the first step's end (passed on a real device)
    assert first["forward"] >= 0 and first["step"] >= first["forward"]
    with pytest.raises(RuntimeError, match="before the host waited"):
        span.end.seconds_to(clock.mark())  # the second step's marks are still unread
    second, = clock.flush()  # the run's end (or a log step) waits for the last one
    assert second["backward"] >= 0 and second["forward"] == 0
    with pytest.raises(ValueError, match="no phase 'fwd'"):
        with clock.span("fwd"):
            pass


def test_a_cpu_run_keeps_the_host_clock(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{"train.max_iters": 2})
    world = cpu_world(MPI.COMM_SELF)
    Trainer(cfg, world, verbose=False).fit()
    assert world.accel.clock.name == HOST
    assert json.loads((tmp_path / "summary.json").read_text())["timing"]["clock"] == HOST


def test_profile_writes_a_trace_per_rank_of_the_traced_steps(fake_run):
    out = fake_run[0]
    assert (out / "trace" / "rank0.json").is_file()
    traces = summarize_run_traces(out)
    assert list(traces) == [0]
    s = traces[0]
    assert s["steps"] == 2 and s["source"] == "cpu"  # the fake device has no kernels
    assert 0 < s["busy_ms"] <= s["span_ms"] and 0 <= s["idle_share"] < 1
    assert s["top"] and all(t["name"].startswith("aten::") or t["count"] > 0
                            for t in s["top"])
    # the phase clock names its spans in the trace: per traced step, each phase the
    # main thread brackets (the fake device's backward runs on a thread the profiler
    # does not follow, so its hooks are not there)
    assert {"data", "forward", "backward", "optimizer"} <= set(s["phases_ms"])
    assert all(v > 0 for v in s["phases_ms"].values())
    assert s["phases_ms"]["forward"] < s["span_ms"] / s["steps"]


def test_a_traced_step_beyond_the_run_is_refused(dataset_path, tmp_path):
    with pytest.raises(ConfigError, match="raise --train.max_iters"):  # by the config
        tiny_config(dataset_path, tmp_path, **{"train.max_iters": 4, "train.profile": "4-6"})
    assert tiny_config(dataset_path, tmp_path, **{"train.max_iters": 6,
                                                  "train.profile": "4-6"}).train.traced_steps \
        == range(4, 7)


def test_a_trace_from_an_earlier_run_is_moved_aside_not_replaced(dataset_path, tmp_path):
    earlier = tmp_path / "trace" / "rank0.json"
    earlier.parent.mkdir()
    earlier.write_text("{}")
    cfg = tiny_config(dataset_path, tmp_path, **{"train.max_iters": 1, "train.profile": "1"})
    with pytest.raises(UserError, match=r"outputs \(trace\).*--train.overwrite"):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    cfg = tiny_config(dataset_path, tmp_path, **{"train.max_iters": 1, "train.profile": "1",
                                                 "train.overwrite": True})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    moved = list(tmp_path.glob("previous-*/trace/rank0.json"))
    assert len(moved) == 1 and moved[0].read_text() == "{}"
    assert summarize_run_traces(tmp_path)[0]["steps"] == 1
