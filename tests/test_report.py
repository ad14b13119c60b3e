"""``hpctrain report``: reading a run (a record still being written, a corrupt line),
joining a resumed run's segments, labels, and the page with every plot embedded."""

import base64
import html
import json
import re
import sys

import pytest

from hpctrain.cli.dispatch import main
from hpctrain.report.page import build_report
from hpctrain.report.runs import join_segments, read_run, split_segments
from tests.helpers import run as run_command
from tests.report_runs import (finished_run, resumed_run, segment, step_record, summary,
                               write_run)

PLOTS = ("loss_step", "loss_time", "throughput", "phases", "memory")


def test_a_resumed_run_is_joined_on_one_clock_and_the_later_segment_wins(tmp_path):
    run = read_run(resumed_run(tmp_path / "r"))
    assert run.segments == 2
    assert [r["step"] for r in run.records] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    # Steps 50 and 60 come from the second segment (it resumed from step 40).
    assert all(r["started_at"] == 5000.0 for r in run.records if r["step"] > 40)
    # The clock runs on: the second segment starts where the first one's last record was.
    first_end = 60 * 0.1
    by_step = {r["step"]: r["wall_s"] for r in run.records}
    assert by_step[40] == pytest.approx(4.0)
    assert by_step[50] == pytest.approx(first_end + 1.0)
    assert by_step[100] == pytest.approx(first_end + 6.0)
    walls = [r["wall_s"] for r in run.records]
    assert walls == sorted(walls)
    assert run.label == "r: dp=1 pp=2 tp=1 zero=0, gpt 2x32"


def test_three_segments_run_on_one_clock_each_after_the_last():
    """Resumed twice: each segment's clock starts where the one before it ended (two
    segments cannot tell an offset that only counts the latest segment)."""
    first = segment(range(10, 61, 10), 1000.0, 0)  # 1.0 .. 6.0 s
    second = segment(range(50, 81, 10), 2000.0, 40)  # from step 40: 1.0 .. 4.0 s
    third = segment(range(80, 101, 10), 3000.0, 70)  # from step 70: 1.0 .. 3.0 s
    steps, _ = join_segments(split_segments(first + second + third))
    assert [(r["step"], r["segment"]) for r in steps] == [
        (10, 0), (20, 0), (30, 0), (40, 0), (50, 1), (60, 1), (70, 1), (80, 2), (90, 2),
        (100, 2)]
    assert [r["wall_s"] for r in steps] == pytest.approx(
        [1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 9.0, 11.0, 12.0, 13.0])


def test_a_final_evaluation_abandoned_by_a_resume_is_dropped():
    first = segment(range(10, 41, 10), 1.0, 0) + [
        {"step": 40, "final_val_loss": 2.5, "elapsed_s": 5.0, "started_at": 1.0,
         "start_step": 0}]
    second = segment(range(30, 61, 10), 2.0, 20)
    steps, final = join_segments(split_segments(first + second))
    assert final is None and [r["step"] for r in steps] == [10, 20, 30, 40, 50, 60]
    steps, final = join_segments(split_segments(first))
    assert final["final_val_loss"] == 2.5 and final["wall_s"] == 5.0


def test_records_without_segment_fields_split_where_the_step_goes_back():
    old = [{k: v for k, v in step_record(s, 0, 0, 0).items()
            if k not in ("elapsed_s", "started_at", "start_step")} for s in (10, 20, 30, 20, 30)]
    segments = split_segments(old)
    assert [[r["step"] for r in s] for s in segments] == [[10, 20, 30], [20, 30]]
    steps, _ = join_segments(segments)
    # The second segment resumed after step 10 (the last step before its first one): its
    # 20 and 30 replace the first's. The clock: 100 ms per step, segments end to end.
    assert [(r["step"], r["segment"]) for r in steps] == [(10, 0), (20, 1), (30, 1)]
    assert [round(r["wall_s"], 6) for r in steps] == [1.0, 4.0, 5.0]


def test_a_record_still_being_written_is_skipped_and_noted(tmp_path):
    path = write_run(tmp_path / "going", segment(range(10, 31, 10), 1.0, 0),
                     tail='{"step": 40, "lo')
    run = read_run(path)
    assert [r["step"] for r in run.records] == [10, 20, 30] and run.summary is None
    assert any("partial last line" in n for n in run.notes)


@pytest.mark.parametrize("case, message", [
    ("missing", "is not a directory"),
    ("empty_dir", "holds no metrics.jsonl"),
    ("corrupt", "line 2"),
    ("not_a_record", "line 1"),
    ("loss_not_a_number", "line 2: loss is 'nan?', not a number"),
    ("load_not_a_table", "line 2: moe_load is [1, 2], not a table of numbers"),
    ("deep_summary", "summary.json: maximum recursion depth exceeded"),
])
def test_bad_input_is_one_message_and_exit_2(tmp_path, capsys, case, message):
    path = tmp_path / case
    if case == "empty_dir":
        path.mkdir()
    elif case == "corrupt":
        write_run(path, segment([10], 1.0, 0), tail='{"step": 20, oops}\n')
    elif case == "not_a_record":
        write_run(path, [], tail='[1, 2]\n')
    elif case == "deep_summary":
        write_run(path, segment([10], 1.0, 0))
        (path / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    elif case == "load_not_a_table":
        write_run(path, segment([10], 1.0, 0), tail='{"step": 20, "moe_load": [1, 2]}\n')
    elif case == "loss_not_a_number":
        write_run(path, segment([10], 1.0, 0), tail='{"step": 20, "loss": "nan?"}\n')
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (path / "report" / "report.html").exists()


def test_several_runs_need_an_out_folder(tmp_path, capsys):
    a, b = finished_run(tmp_path / "a"), finished_run(tmp_path / "b")
    assert main(["report", str(a), str(b)]) == 2
    assert "--out" in capsys.readouterr().err


def test_two_runs_overlaid_on_one_page_without_torch_or_mpi(tmp_path):
    """The command end to end, as a user runs it: every plot a PNG, the page holds them
    all (no file or network reference), and neither torch nor mpi4py is imported."""
    a = finished_run(tmp_path / "dp2", dp=2)
    b = resumed_run(tmp_path / "pp2")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("kept")
    p = run_command([sys.executable, "-X", "importtime", "-m", "hpctrain", "report", str(a),
                     str(b), "--out", str(tmp_path / "out")])
    assert p.returncode == 0, p.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hpctrain.report.plots" in imported
    assert sorted(m for m in imported if m.split(".")[0] in ("torch", "mpi4py")) == []
    out = tmp_path / "out"
    assert (out / "mine.txt").read_text() == "kept"
    for name in PLOTS:
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    sources = re.findall(r"<img src='([^']*)'", page)
    assert len(sources) == len(PLOTS)
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:4] == b"\x89PNG"
    assert not re.search(r"(src|href)=['\"](?!data:)", page)  # nothing fetched
    for label in ("dp2: dp=2 pp=1 tp=1 zero=0", "pp2: dp=1 pp=2 tp=1 zero=0"):
        assert label in page


def test_a_run_still_going_is_drawn_from_its_records(tmp_path):
    path = write_run(tmp_path / "going", segment(range(10, 51, 10), 1.0, 0),
                     tail='{"step": 60, "lo')
    step_dir = path / "checkpoints" / "step_000040"
    step_dir.mkdir(parents=True)
    (path / "checkpoints" / "latest").write_text("step_000040\n")
    (step_dir / "manifest.json").write_text(json.dumps(
        {"world_size": 4, "config": summary(2, 2, 1, 40)["config"]}))
    assert read_run(path).label == "going: dp=2 pp=2 tp=1 zero=1, gpt 2x32"
    page = build_report([path])
    assert page == path / "report" / "report.html"
    text = page.read_text()
    assert text.count("<img src='data:image/png;base64,") == 3  # no phases, no memory yet
    assert "No `summary.json`" not in text and "No <code>summary.json</code>" in text
    assert "partial last line" in text
    assert sorted(p.name for p in (path / "report" / "plots").iterdir()) == [
        "loss_step.png", "loss_time.png", "throughput.png"]


def test_the_overlay_draws_one_line_per_run_and_segment(tmp_path):
    from hpctrain.plotting import pyplot
    from hpctrain.report import plots

    runs = [read_run(finished_run(tmp_path / "a")), read_run(resumed_run(tmp_path / "b"))]
    fig, ax = pyplot().subplots()
    plots._loss(runs, ax, "wall_s")
    lines = [ln for ln in ax.get_lines() if ln.get_linestyle() != "None"]  # no validation
    # a: one segment; b: two, drawn in one colour, one legend entry.
    assert len(lines) == 3 and lines[1].get_color() == lines[2].get_color()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        runs[0].label, f"{runs[0].label} (validation)", runs[1].label,
        f"{runs[1].label} (validation)"]
    assert list(lines[2].get_xdata()) == [r["wall_s"] for r in runs[1].records
                                          if r["segment"] == 1]
    pyplot().close(fig)


def _training_lines(ax) -> list:
    """The first line of each run's curve (the labelled one; validation has no line)."""
    return [ln for ln in ax.get_lines() if ln.get_linestyle() != "None"
            and not ln.get_label().startswith("_")]


def _legend_clear_of_the_data(fig, ax) -> None:
    """The legend's box, in display coordinates, meets neither the axes nor the extent of
    their data (every curve's point, every bar), and lies inside what
    ``savefig(bbox_inches="tight")`` keeps."""
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    kept = fig.get_tightbbox().transformed(fig.dpi_scale_trans)
    assert kept.contains(legend.x0, legend.y0) and kept.contains(legend.x1, legend.y1)
    assert not legend.overlaps(ax.dataLim.transformed(ax.transData))
    assert not legend.overlaps(ax.get_window_extent())


def test_coinciding_runs_each_keep_a_style_and_the_legend_covers_no_data(tmp_path):
    """Three runs with the same losses and throughput (1, 2 and 4 ranks of one model):
    each curve has its own (line style, marker) and its markers on other points, so none
    hides another; every legend lies outside its axes."""
    from hpctrain.plotting import pyplot
    from hpctrain.report import plots

    runs = [read_run(finished_run(tmp_path / f"dp{n}", dp=n)) for n in (1, 2, 4)]
    for fig in (plots.draw_loss(runs, "step"), plots.draw_loss(runs, "wall_s"),
                plots.draw_throughput(runs)):
        for ax in fig.axes:
            lines = _training_lines(ax)
            assert [ln.get_label() for ln in lines] == [r.label for r in runs]
            assert len({(ln.get_linestyle(), ln.get_marker()) for ln in lines}) == 3
            assert len({ln.get_markevery() for ln in lines}) == 3
            assert lines[0].get_ydata().tolist() == lines[2].get_ydata().tolist()
            _legend_clear_of_the_data(fig, ax)
        pyplot().close(fig)
    assert len({(s["linestyle"], s["marker"]) for s in map(plots.run_style, range(28))}) == 28
    fig = plots.draw_memory(runs)
    legends = [ax for ax in fig.axes if ax.get_legend() is not None]
    assert legends == [fig.axes[2]]  # one, beside the last run's stacked bars
    _legend_clear_of_the_data(fig, legends[0])
    pyplot().close(fig)


def test_without_an_mfu_the_throughput_has_no_empty_panel_and_the_page_says_why(tmp_path):
    from hpctrain.plotting import pyplot
    from hpctrain.report import plots

    cpu = write_run(tmp_path / "cpu", [{**r, "mfu": None} for r in segment(
        range(10, 51, 10), 1.0, 0)])
    gpu = write_run(tmp_path / "gpu", segment(range(10, 51, 10), 1.0, 0))
    fig = plots.draw_throughput([read_run(cpu)])
    assert len(fig.axes) == 1 and fig.axes[0].get_ylabel() == "tokens/s (all ranks)"
    pyplot().close(fig)
    fig = plots.draw_throughput([read_run(cpu), read_run(gpu)])
    assert [ax.get_ylabel() for ax in fig.axes] == ["tokens/s (all ranks)", "MFU, %"]
    assert [ln.get_label() for ln in _training_lines(fig.axes[1])] == ["gpu"]
    pyplot().close(fig)
    page = html.unescape(build_report([cpu, gpu], tmp_path / "out").read_text())
    assert "No MFU for cpu: the device's peak is unknown" in page


def test_a_summary_of_an_earlier_segment_is_noted(tmp_path):
    path = write_run(tmp_path / "r", segment(range(10, 61, 10), 1.0, 0), summary(1, 1, 0, 40))
    assert any("earlier segment (step 40)" in n for n in read_run(path).notes)


def test_memory_per_rank_comes_from_every_rank(tmp_path):
    from hpctrain.report.plots import memory_rows

    run = read_run(write_run(tmp_path / "m", segment([10], 1.0, 0), summary(2, 2, 1, 10)))
    rows = memory_rows(run)
    assert [r for r, _ in rows] == ["0", "1", "2", "3"]
    assert [row["peak_rss_bytes"] >> 20 for _, row in rows] == [400, 401, 402, 403]
    assert json.loads((tmp_path / "m" / "summary.json").read_text())["world_size"] == 4


def test_a_mixture_of_experts_run_gets_its_expert_load_drawn(tmp_path):
    """The busiest expert over the mean per logged step, and the last step's shares;
    a dense run's page has no such section."""
    loads = {10: [[30.0, 10.0, 0.0, 0.0], [10.0, 10.0, 10.0, 10.0]],
             20: [[12.0, 10.0, 9.0, 9.0], [10.0, 10.0, 10.0, 10.0]]}
    records = [{**r, "moe_load": loads[r["step"]], "moe_imbalance": 3.0 if r["step"] == 10
                else 1.2} for r in segment([10, 20], 1.0, 0)]
    moe = write_run(tmp_path / "moe", records)
    text = build_report([moe]).read_text()
    assert "Expert load" in text
    png = moe / "report" / "plots" / "expert_load.png"
    assert png.read_bytes()[:4] == b"\x89PNG"
    dense = write_run(tmp_path / "dense", segment([10, 20], 1.0, 0))
    assert "Expert load" not in build_report([dense]).read_text()
