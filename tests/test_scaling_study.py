"""Study specs, records, efficiency, the report builder, job emission and the CLI's
errors (single process; records are written by hand where no run is needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import UserError
from hpctrain.scaling import analysis
from hpctrain.scaling.records import from_summary, read_records, write_record
from hpctrain.scaling.study_report import build_study_report
from hpctrain.scaling.spec import load_study

SPEC = """
[study]
name = "t"
scaling = "{scaling}"
ranks = [1, 2, 4]
steps = 5
overrides = ["--data.path=nowhere.h5"]

[batch]
{batch}

[[models]]
name = "m"
n_layer = 4
n_head = 2
n_embd = 32
block_size = 16
vocab_size = 50

[[parallel]]
name = "dp"
zero = [0, 3]

[[parallel]]
name = "pipe"
pp = [2, 4]
micro_batches = 4
"""


def _write(tmp_path, text, name="s.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_weak_spec_expands_and_skips_with_reasons(tmp_path):
    s = load_study(_write(tmp_path, SPEC.format(scaling="weak", batch="per_rank = 4")))
    ids = [p.id for p in s.points]
    # dp: 2 stages x 3 rank counts; pipe: pp=2 at 2 and 4 ranks, pp=4 at 4 ranks.
    assert len(ids) == 9 and len(set(ids)) == 9
    assert "m-pipe-z0-pp2-1f1b-m4-n4" in ids
    by_id = {p.id: p for p in s.points}
    assert by_id["m-dp-z3-pp1-m1-n4"].arrangement.global_batch == 16  # 4 per dp rank
    assert by_id["m-pipe-z0-pp2-1f1b-m4-n4"].arrangement.global_batch == 8  # dp = 2
    reasons = " ".join(r for _, r in s.skipped)
    assert "pp=2 does not divide 1" in reasons and "pp=4 does not divide 2" in reasons


def test_study_runs_train_the_modelled_shape(tmp_path):
    """The run trains exactly what the performance model counts: the shape, and no
    vocabulary padding (``ModelShape.vocab_multiple`` = 1) although training pads by
    default."""
    from hpctrain.config import load_config
    from hpctrain.scaling.runner import train_command

    s = load_study(_write(tmp_path, SPEC.format(scaling="weak", batch="per_rank = 4")))
    point = s.points[0]
    cmd = train_command(s, point, tmp_path / "out")
    cfg = load_config(cmd[1], cmd[2:])
    assert cfg.model.to_gpt() == point.model.gpt
    llama = SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "vocab_size = 50", 'vocab_size = 50\narch = "llama"\nn_kv_head = 1\n'
                           "tie_embeddings = false\nrope_theta = 500000.0")
    s = load_study(_write(tmp_path, llama, "llama.toml"))
    cmd = train_command(s, s.points[0], tmp_path / "out")
    gpt = load_config(cmd[1], cmd[2:]).model.to_gpt()
    assert gpt == s.points[0].model.gpt and (gpt.arch, gpt.n_kv_head) == ("llama", 1)


def test_strong_spec_keeps_the_global_batch(tmp_path):
    s = load_study(_write(tmp_path, SPEC.format(scaling="strong", batch="global = 16")))
    assert {p.arrangement.global_batch for p in s.points} == {16}


@pytest.mark.parametrize("edit,match", [
    (("per_rank = 4", "global = 4"), "weak scaling fixes"),
    (('scaling = "weak"', 'scaling = "wide"'), "use \"weak\""),
    (("ranks = [1, 2, 4]", "ranks = [1, 2, 4]\nnodes = [1]"), "exactly one of"),
    (("steps = 5", "steps = 5\nstep = 5"), "unknown key"),
    (("zero = [0, 3]", "zero = [0, 5]"), "stages are 0, 1, 2, 3"),
    (("ranks = [1, 2, 4]", "ranks = [0]"), "integer >= 1"),
    (("vocab_size = 50", ""), "lacks vocab_size"),
    (("n_head = 2", "n_head = 3"), "multiple of n_head"),
])
def test_spec_errors_name_the_fix(tmp_path, edit, match):
    text = SPEC.format(scaling="weak", batch="per_rank = 4").replace(*edit)
    with pytest.raises(UserError, match=match):
        load_study(_write(tmp_path, text))


def test_nodes_need_ranks_per_node(tmp_path):
    text = SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "ranks = [1, 2, 4]", "nodes = [1, 2]")
    with pytest.raises(UserError, match="ranks per node"):
        load_study(_write(tmp_path, text))
    s = load_study(_write(tmp_path, text), ranks_per_node=4)
    assert {p.arrangement.ranks for p in s.points} == {4, 8}
    assert {p.nodes for p in s.points} == {1, 2}


def _summary(ranks, step_ms, batch, shares=None):
    return {"world_size": ranks, "flops_per_token": 1e6, "peak_tflops": None, "params": 10,
            "wall_s": 1.0, "peak_rss_bytes_max_rank": 300 << 20, "memory_per_rank": {},
            "config": {"train": {"batch_size": batch}, "model": {"block_size": 16}},
            "timing": {"step_ms_median": step_ms, "step_ms_p90": step_ms * 1.1,
                       "warmup_steps": 1, "measured_steps": 4,
                       "shares": shares or {"compute": 0.8, "comm": 0.2, "bubble": 0.0,
                                            "data": 0.0}}}


def test_from_summary_throughput_uses_the_median_step():
    m = from_summary(_summary(2, 100.0, 8), peak_flops=1e9)
    assert m["tokens_per_s"] == pytest.approx(8 * 16 / 0.1)
    assert m["tokens_per_s_per_rank"] == pytest.approx(640)
    assert m["tflops_per_rank"] == pytest.approx(1e6 * 640 / 1e12)
    assert m["mfu"] == pytest.approx(1e6 * 640 / 1e9)


def _record(point, series, ranks, step_ms, batch, *, repeat=0, pred_ms=None, index=0,
            status="ok"):
    rec = {"schema": 1, "study": "t", "point": point, "index": index, "repeat": repeat,
           "series": series, "parallel": series, "scaling": "weak", "status": status,
           "error": None if status == "ok" else "exit status 2: error: bad option",
           "config": {"ranks": ranks, "nodes": 1, "dp": ranks, "pp": 1, "zero": 0,
                      "micro_batches": 1, "micro_batch_rows": batch // ranks,
                      "global_batch": batch, "seq_len": 16, "dtype": "fp32"},
           "measured": from_summary(_summary(ranks, step_ms, batch)) if status == "ok" else None}
    if pred_ms is not None:
        rec["prediction"] = {"step_s": pred_ms / 1e3, "compute_s": pred_ms / 1e3, "bubble_s": 0,
                             "p2p_s": 0, "grad_comm_s": 0, "gather_s": 0, "optimizer_s": 0,
                             "oversubscription": 1.0, "memory_bytes": 1 << 28}
    return rec


def test_efficiency_definitions():
    recs = [_record("a1", "s", 1, 100.0, 4), _record("a2", "s", 2, 125.0, 8),
            _record("a4", "s", 4, 200.0, 16)]
    pts = analysis.aggregate(recs)
    weak = analysis.efficiency(pts, "weak")
    assert weak == pytest.approx({1: 1.0, 2: 0.8, 4: 0.5})
    strong = analysis.efficiency(pts, "strong")  # T(1) 1 / (T(N) N)
    assert strong == pytest.approx({1: 1.0, 2: 100 / 250, 4: 100 / 800})
    assert analysis.ideal_throughput(pts)[4] == pytest.approx(4 * pts[0].tokens_per_s)


def test_repeats_reduce_to_medians_and_failures_are_kept():
    recs = [_record("a", "s", 1, v, 4, repeat=i) for i, v in enumerate((100.0, 300.0, 110.0))]
    recs.append(_record("a", "s", 1, 0.0, 4, repeat=3, status="failed"))
    (p,) = analysis.aggregate(recs)
    assert p.step_ms == pytest.approx(110.0) and p.runs == 4 and p.failed == 1
    assert p.errors == ["exit status 2: error: bad option"]


def _study_folder(tmp_path, recs) -> Path:
    folder = tmp_path / "study"
    (folder / "records").mkdir(parents=True)
    (folder / "study.json").write_text(json.dumps({
        "name": "t", "scaling": "weak", "steps": 5, "repeats": 1, "spec": "s.toml",
        "system": "local", "calibration": "c.json", "git": {"sha": "abc", "dirty": False},
        "environment": {"host": "h"}, "skipped": [{"point": "x", "reason": "pp=2 ..."}]}))
    for r in recs:
        write_record(folder / "records" / f"{r['point']}-r{r['repeat']}.json", r)
    return folder


def test_report_builder_writes_tables_plots_and_errors(tmp_path):
    recs = [_record("a1", "s", 1, 100.0, 4, pred_ms=110.0, index=0),
            _record("a2", "s", 2, 125.0, 8, pred_ms=60.0, index=1),
            _record("a4", "s", 4, 200.0, 16, index=2, status="failed")]
    folder = _study_folder(tmp_path, recs)
    assert len(read_records(folder)) == 3
    paths = build_study_report(folder)
    md = (folder / "report.md").read_text()
    assert "| a1 | 1 | 1 |" in md
    assert "+10.0%" in md and "-52.0%" in md  # (predicted - measured) / measured
    assert "**1 of 2** points within +-25%" in md
    assert "| a2 | 125.0 | 60.0 | -52.0% | **no**" in md
    assert "## Failed runs" in md and "bad option" in md
    assert "| s | 640 (1.00) | 1,024 (0.80) | - |" in md  # weak: 1024 / (2 x 640)
    assert "pp=2 ..." in md
    html = (folder / "report.html").read_text()
    assert html.count("<table>") == 4 and "<img src='plots/prediction.png'" in html
    pngs = [p for p in paths if p.suffix == ".png"]
    assert {p.name for p in pngs} == {"throughput.png", "efficiency.png", "breakdown.png",
                                      "prediction.png"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_report_of_an_empty_folder_is_a_user_error(tmp_path, capsys):
    assert main(["scale", "report", str(tmp_path)]) == 2
    assert "no study.json" in capsys.readouterr().err


def test_cli_errors_exit_2(tmp_path, capsys):
    assert main(["scale", "run", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plan", "--system", "polaris", "--nodes", "2", "--model", "gpt5"]) == 2
    assert "unknown model" in capsys.readouterr().err
    spec = _write(tmp_path, SPEC.format(scaling="weak", batch="per_rank = 4"))
    assert main(["scale", "run", str(spec), "--queue", "debug"]) == 2
    assert "--jobs DIR" in capsys.readouterr().err


def test_plan_cli_prints_a_ranked_table(capsys):
    assert main(["plan", "--system", "aurora", "--nodes", "16", "--model", "gpt2-xl",
                 "--top", "3", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "192 ranks" in out and "fastest first" in out
    assert out.count("\n1  ") + out.count("\n#1:") >= 1
    assert "pipeline bubble" in out and "memory per rank" in out


def test_job_scripts_per_point_and_one_job(tmp_path):
    text = SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "ranks = [1, 2, 4]", "nodes = [1, 2]").replace('steps = 5', 'steps = 5\nsystem = "polaris"')
    spec = _write(tmp_path, text)
    out = tmp_path / "jobs"
    common = ["--system", "polaris", "--account", "P", "--queue", "debug",
              "--walltime", "00:10:00", "--venv", "none"]
    assert main(["scale", "run", str(spec), "--jobs", str(out), *common]) == 0
    index = json.loads((out / "jobs.json").read_text())["jobs"]
    assert len(index) == 8  # (dp: 2 stages; pipe: pp 2 and 4) x 4 and 8 ranks
    script = (out / "t-p000r0.sh").read_text()
    assert "#PBS -l select=1:system=polaris" in script and "--parallel.zero=0" in script
    assert "--train.out_dir" not in script.split("LAUNCH=(")[0]
    assert (out / "submit_all.sh").read_text().count("qsub ") == 8
    assert main(["scale", "run", str(spec), "--jobs", str(tmp_path / "one"), "--one-job",
                 *common]) == 0
    one = (tmp_path / "one" / "study-t.sh").read_text()
    assert "#PBS -l select=2:system=polaris" in one
    assert "-m hpctrain scale run" in one and "--launch-system polaris" in one


# ------------------------------------------------------------------ one reader of studies

@pytest.mark.parametrize("content, message", [
    (None, "does not exist; see perf/studies/local.toml"),
    ("[study\nname = 1", "not valid TOML"),
    (b"\xff\xfe[study]", "is not UTF-8 text"),
    (SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "ranks = [1, 2, 4]", 'nodes = [1]\nsystem = "summit"'),
     "system = 'summit': unknown system 'summit'; built-in systems: aurora"),
    (SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "vocab_size = 50", "").replace('"--data.path=nowhere.h5"', '"--data.pth=x"'),
     "recipe and overrides: unknown option --data.pth"),
])
def test_a_broken_study_file_is_one_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "s.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(UserError) as e:
        load_study(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_nodes_take_the_ranks_per_node_of_the_study_s_system(tmp_path):
    text = SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "ranks = [1, 2, 4]", 'nodes = [1, 2]\nsystem = "aurora"')
    assert load_study(_write(tmp_path, text)).ranks == (12, 24)  # aurora: 12 per node


def test_scale_run_reads_the_study_file_once(tmp_path, monkeypatch):
    from hpctrain.scaling import spec as spec_module

    reads = []
    real = spec_module.read_spec
    monkeypatch.setattr(spec_module, "read_spec", lambda p: reads.append(p) or real(p))
    parses = []
    real_loads = spec_module.tomllib.loads
    monkeypatch.setattr(spec_module.tomllib, "loads", lambda t: parses.append(t) or real_loads(t))
    text = SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "ranks = [1, 2, 4]", "nodes = [1, 2]").replace('steps = 5', 'steps = 5\nsystem = "polaris"')
    spec = _write(tmp_path, text)
    assert main(["scale", "run", str(spec), "--jobs", str(tmp_path / "jobs"), "--system",
                 "polaris", "--account", "P", "--queue", "debug", "--walltime", "00:10:00",
                 "--venv", "none"]) == 0
    assert reads == [spec] and sum(t == text for t in parses) == 1


def test_one_job_script_launches_the_study_runner_quoted(tmp_path):
    # The study path reaches the script through the template's quoting, like every word.
    folder = tmp_path / "a b'c $(touch PWNED) `x`"
    folder.mkdir()
    text = SPEC.format(scaling="weak", batch="per_rank = 4").replace(
        "ranks = [1, 2, 4]", "nodes = [1, 2]").replace('steps = 5', 'steps = 5\nsystem = "polaris"')
    spec = _write(folder, text)
    assert main(["scale", "run", str(spec), "--jobs", str(tmp_path / "one"), "--one-job",
                 "--system", "polaris", "--account", "P", "--queue", "debug", "--walltime",
                 "00:10:00", "--venv", "none"]) == 0
    script = (tmp_path / "one" / "study-t.sh").read_text()
    lines = script.splitlines()
    start = lines.index("LAUNCH=(")
    block = "\n".join(lines[start:lines.index(")", start) + 1])
    p = subprocess.run(["bash", "-c", 'PYTHON=/py RUN_DIR=/r\n' + block +
                        '\nprintf "%s\\0" "${LAUNCH[@]}"'],
                       capture_output=True, timeout=10, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.decode().split("\0")[:-1] == [
        "/py", "-m", "hpctrain", "scale", "run", str(spec.resolve()), "--launch-system",
        "polaris", "--out", "/r/study"]
    assert not (tmp_path / "PWNED").exists()
