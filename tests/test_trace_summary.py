"""``report/trace_summary.py`` on hand-made traces with known intervals (the union, the
idle share, the top kernels, a CPU trace's outermost operators), refusals of files that
are too large or not trace JSON, and the report page's Trace tables. A real trace from a
run: ``tests/test_phase_clock.py``."""

from __future__ import annotations

import json

import pytest

from hpctrain.errors import UserError
from hpctrain.report.page import build_report
from hpctrain.report.trace_summary import (read_trace, summarize_run_traces,
                                           summarize_trace, union_us)
from tests.report_runs import finished_run


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _write(path, events):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events}))
    return path


GPU_EVENTS = [
    _x("ProfilerStep#2", "user_annotation", 0, 1000),
    _x("ProfilerStep#3", "user_annotation", 1000, 1000),
    _x("aten::mm", "cpu_op", 10, 100),
    # Stream 7: gemm 100-300 and 500-700; stream 8: a copy 250-400 that overlaps it, a
    # memset inside the second gemm. Busy: 100-400 and 500-700 = 500 us.
    _x("gemm", "kernel", 100, 200, tid=7),
    _x("gemm", "kernel", 500, 200, tid=7),
    _x("Memcpy HtoD", "gpu_memcpy", 250, 150, tid=8),
    _x("Memset", "gpu_memset", 550, 50, tid=8),
    {"ph": "i", "name": "an instant", "ts": 5},  # no duration: not counted
    _x("late host op", "cpu_op", 1900, 100),  # the trace's last event ends at 2000 us
]


def test_overlapping_kernels_count_once_and_the_idle_share_is_the_rest(tmp_path):
    s = summarize_trace(_write(tmp_path / "rank0.json", GPU_EVENTS))
    assert s["source"] == "device" and s["steps"] == 2
    assert s["busy_ms"] == pytest.approx(0.5) and s["span_ms"] == pytest.approx(2.0)
    assert s["idle_share"] == pytest.approx(0.75)
    top = {t["name"]: t for t in s["top"]}
    assert [t["name"] for t in s["top"]] == ["gemm", "Memcpy HtoD", "Memset"]
    assert top["gemm"]["ms"] == pytest.approx(0.4) and top["gemm"]["count"] == 2
    assert top["gemm"]["share"] == pytest.approx(400 / 600)
    assert sum(t["share"] for t in s["top"]) == pytest.approx(1.0)


def test_union_of_intervals():
    assert union_us([]) == 0
    assert union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert union_us([(0, 10), (10, 20)]) == 20


def test_a_cpu_trace_ranks_the_outermost_host_operators(tmp_path):
    events = [_x("ProfilerStep#1", "user_annotation", 0, 100),
              _x("aten::linear", "cpu_op", 0, 40), _x("aten::addmm", "cpu_op", 5, 30),
              _x("aten::linear", "cpu_op", 50, 20),
              _x("aten::add", "cpu_op", 60, 30, tid=2)]  # another thread: outermost there
    s = summarize_trace(_write(tmp_path / "rank0.json", events))
    assert s["source"] == "cpu" and s["steps"] == 1
    assert [(t["name"], t["count"]) for t in s["top"]] == [("aten::linear", 2),
                                                          ("aten::add", 1)]
    assert s["top"][0]["ms"] == pytest.approx(0.06)  # addmm inside linear is not counted
    assert s["busy_ms"] == pytest.approx(0.08)  # 0-40 and 50-90
    assert s["idle_share"] == pytest.approx(0.2)


@pytest.mark.parametrize("text,why", [("{not json", "not a trace's JSON"),
                                      ("[1, 2]", "not a trace's JSON"),
                                      ('{"traceEvents": 3}', "no traceEvents list")])
def test_a_file_that_is_not_a_trace_is_refused_in_one_line(tmp_path, text, why):
    path = tmp_path / "rank0.json"
    path.write_text(text)
    with pytest.raises(UserError, match=why):
        summarize_trace(path)


def test_a_trace_over_the_size_limit_is_refused(tmp_path):
    path = _write(tmp_path / "rank0.json", GPU_EVENTS)
    with pytest.raises(UserError, match="trace fewer steps"):
        read_trace(path, limit=100)


def test_the_report_has_a_trace_table_per_rank(tmp_path, capsys):
    run = finished_run(tmp_path / "run")
    for rank in (0, 1):
        _write(run / "trace" / f"rank{rank}.json", GPU_EVENTS)
    (run / "trace" / "notes.json").write_text("{}")  # not a rank's: left alone
    assert list(summarize_run_traces(run)) == [0, 1]
    lines = []
    page = build_report([run], log=lines.append).read_text()
    assert page.count("rank 0: 2 step(s), span 2.0 ms, busy 0.5 ms, idle 75.0%") == 1
    assert "rank 1: 2 step(s)" in page and "<code>gemm</code>" in page
    assert len(lines) == 2 and "trace rank 1: 2 step(s)" in lines[1]


def _launch(ts, corr, tid):
    return {**_x("cudaLaunchKernel", "cuda_runtime", ts, 5, tid=tid), "args": {"correlation": corr}}


def _kernel(ts, dur, corr):
    return {**_x("k", "kernel", ts, dur, tid=7), "args": {"correlation": corr}}


def test_device_phases_take_each_kernel_from_the_range_open_at_its_launch_on_any_thread(
        tmp_path):
    # One step. The main thread (tid 1) brackets forward 0-100 and backward 100-400;
    # autograd's thread (tid 2) launches the backward's kernels, one of them inside a
    # hook's range; the device runs each kernel well after its launch.
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 500),
        _x("phase:forward", "user_annotation", 0, 100),
        _x("phase:backward", "user_annotation", 100, 300),
        _x("phase:hooks", "user_annotation", 300, 20, tid=2),
        _launch(10, 1, tid=1), _kernel(50, 100, 1),      # forward: 50-150
        _launch(150, 2, tid=2), _kernel(150, 100, 2),    # backward: 150-250
        _launch(305, 3, tid=2), _kernel(250, 50, 3),     # hooks (and backward): 250-300
        _launch(450, 4, tid=1), _kernel(460, 30, 4),     # after every phase: none
        _kernel(480, 10, 99),                            # no launch seen: none
    ]
    s = summarize_trace(_write(tmp_path / "rank0.json", events))
    assert s["source"] == "device"
    assert s["phases_ms"] == {"forward": 0.1, "backward": 0.15, "hooks": 0.05}
