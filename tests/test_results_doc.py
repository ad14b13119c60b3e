"""perf/RESULTS.md is generated from perf/results/*.json and must match them; the pure
helpers the benchmarks share (tree state, figures, efficiency, seed checks). One process,
no MPI, no torch work."""

from __future__ import annotations

import json

import pytest

from perf import make_results
from perf.bench_convergence import seed_checks
from perf.bench_long_context import longest_under
from perf.bench_zero_bubble import held_per_stage, ideal_step, summarize, targets_met
from perf.pipeline_workers import (bubble_theory, combine_stages, measured_idle,
                                   pipeline_efficiency, predicted_idle)
from perf.common import (RESULTS, dirty_paths, fmt, fmt_spread, shakespeare_text, spread,
                         table_lines)


def test_results_md_is_generated_from_the_committed_json():
    expected = make_results.render(RESULTS)
    assert make_results.DOC.read_text() == expected, \
        "perf/RESULTS.md is out of date with perf/results/*.json: run `make results`"


def test_old_json_without_tree_state_or_spreads_renders(tmp_path):
    # A result written before tree_clean, duration and per-repeat lists existed.
    old = {"benchmark": "convergence", "git_sha": "abc1234", "time": "2026-01-01T00:00:00",
           "machine": {"cpus": 2, "platform": "Linux", "python": "3.11", "torch": "2.13"},
           "runs": [{"seed": 1337,
                     "hpctrain_dp2": {"wall_s": 50.0, "final_val_loss": 1.899,
                                      "step_ms_median": 24.0},
                     "nanogpt_style_1proc_2threads": {"wall_s": 60.0, "final_val_loss": 1.9,
                                                      "step_ms_median": 27.0}}],
           "targets": {"val_loss": 1.9}, "met": True}
    (tmp_path / "convergence.json").write_text(json.dumps(old))
    doc = make_results.render(tmp_path)
    assert "Commit `abc1234`, tree clean: unknown" in doc
    assert "duration: unknown" in doc
    assert "| hpctrain, 2 ranks x 1 thread | 1 | 1.899 | 50.000 | 24.000 |" in doc
    assert doc.count("No result yet.") == len(make_results.SECTIONS) - 1


def test_convergence_with_three_rows_and_seed_checks(tmp_path):
    def row(val, wall):
        return {"wall_s": wall, "final_val_loss": val, "step_ms_median": 24.0}

    runs = [{"seed": s, "hpctrain_dp2": row(1.89 + s / 100, 50.0 + s),
             "baseline_matched": row(1.89, 52.0), "nanogpt_style_1proc_2threads": row(1.9, 60.0)}
            for s in (1, 2, 3)]
    d = {"git_sha": "abc1234", "tree_clean": True, "time": "2026-01-01T00:00:00",
         "machine": {}, "steps": 2000, "runs": runs, "targets": {"val_loss": 1.9},
         "met": False, "seed_checks": {"hpctrain_dp2": {"loss_step10_differs": True},
                                       "baseline_matched": {"init_differs": True,
                                                            "data_differs": False}}}
    (tmp_path / "convergence.json").write_text(json.dumps(d))
    doc = make_results.render(tmp_path)
    assert "tree clean: yes" in doc
    assert "| hpctrain, 2 ranks x 1 thread | 3 | 1.910 [1.900, 1.920] | 52.000 [51.000, 53.000]" \
        in doc
    assert "| 1.890 [1.890, 1.890] | 52.000 [52.000, 52.000] |" in doc
    assert "NO (baseline_matched: data_differs)" in doc
    assert "-> missed." in doc


def test_dirty_tree_is_stated(tmp_path):
    d = {"git_sha": "abc1234", "tree_clean": False, "dirty_paths": ["perf/common.py"],
         "time": "2026-01-01T00:00:00", "machine": {}, "duration_s": 90.0}
    line = make_results.provenance(d)
    assert "tree clean: **no**" in line and "`perf/common.py`" in line
    assert "duration: 1.500 min" in line


def test_dirty_paths_ignores_results_and_reads_renames():
    porcelain = "\n".join([" M perf/common.py", "?? perf/results/", " M perf/results/dp.json",
                           "R  old.py -> new.py", '?? "odd name.txt"', "A  tests/test_x.py"])
    assert dirty_paths(porcelain) == ["perf/common.py", "old.py", "new.py", "odd name.txt",
                                      "tests/test_x.py"]
    assert dirty_paths("?? perf/results/quick/\n M perf/results/zero.json\n") == []
    assert dirty_paths("") == []


def test_figures_print_as_stored_with_three_decimals():
    assert fmt(0.955) == "0.955"  # not 0.96
    assert fmt(0.9554) == "0.955"
    assert fmt(1.9) == "1.900"
    assert fmt(1234.6) == "1,235"
    assert fmt(0.0123, scale=1e3) == "12.300"
    assert fmt(7) == "7" and fmt(None) == "n/a" and fmt(True) == "True"


def test_spread_gives_median_mean_min_max():
    s = spread([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["mean"], s["min"], s["max"], s["n"]) == (2.5, 4.0, 1.0, 10.0, 4)
    assert spread([])["n"] == 0
    assert fmt_spread([0.3, 0.1, 0.2]) == "0.200 [0.100, 0.300]"
    assert fmt_spread([0.3, 0.1, 0.2], center="mean") == "0.200 [0.100, 0.300]"
    assert fmt_spread([0.5]) == "0.500"
    assert fmt_spread([0.2, 0.4], scale=1e3) == "300 [200, 400]"


def test_markdown_table():
    assert table_lines(["a", "b"], [[1, 0.5]], markdown=True) == \
        ["| a | b |", "|---|---|", "| 1 | 0.500 |"]


def test_pipeline_efficiency_cannot_exceed_one():
    import random

    rng = random.Random(0)
    for _ in range(200):
        p, steps = rng.choice([2, 4]), 3
        stages = []
        for _ in range(p):
            pipe = [rng.uniform(0.1, 1.0) for _ in range(steps)]
            stages.append({"pipe_s": pipe, "step_s": [x + 0.01 for x in pipe],
                           "compute_s": [x * rng.uniform(0.0, 1.0) for x in pipe],
                           "bubble_s": [x * rng.uniform(0.0, 0.5) for x in pipe]})
        out = combine_stages(stages)
        assert all(0.0 <= e <= 1.0 for e in out["efficiency"])
        assert len(out["bubble"]) == steps
    # A stage computing for its whole phase, the slowest one: efficiency 1.
    assert pipeline_efficiency([1.0, 0.5], [1.0, 0.9]) == 1.0
    assert bubble_theory(4, 8) == pytest.approx(3 / 11)
    assert bubble_theory(4, 8, virtual=2) == pytest.approx(3 / 19)


def test_zero_bubble_idle_measured_and_predicted_like_the_simulator():
    # Two stages computing 3 s and 2 s of a 4 s phase: 1 - 5 / 8 idle.
    stages = [{"pipe_s": [4.0], "compute_s": [3.0]}, {"pipe_s": [3.5], "compute_s": [2.0]}]
    assert measured_idle(stages, 0) == pytest.approx(3 / 8)
    # Passes of 1 s each per micro-batch (m = 4): the unit-time predictions.
    timed = [{"forward_s": [4.0], "backward_s": [4.0], "weight_s": [4.0]}] * 2
    assert predicted_idle("zb-h1", timed, 4) == pytest.approx(1 / 13)
    fused = [{"forward_s": [4.0], "backward_s": [8.0], "weight_s": [0.0]}] * 2
    assert predicted_idle("1f1b", fused, 4) == pytest.approx(1 / 5)


def _zero_bubble_run(step, pipe, compute, stage_passes=None):
    """A worker's result: two stages, one step, optionally the per-pass seconds."""
    stages = [{"pipe_s": [pipe], "compute_s": [compute], **(stage_passes or {})}] * 2
    return {"step_s": [step], "pipe_s": [pipe], "busiest_compute_s": [compute],
            "efficiency": [compute / pipe], "stages": stages}


def test_zero_bubble_summary_gives_ratios_bubbles_and_the_ceiling():
    from perf.bench_zero_bubble import JOBS

    passes = {"forward_s": [4.0], "backward_s": [4.0], "weight_s": [4.0]}
    fused = {"forward_s": [4.0], "backward_s": [8.0], "weight_s": [0.0]}
    steps = {("ours", "zb-h1"): (1.05, 0.9, 0.8), ("ours", "zbv"): (0.95, 0.85, 0.8),
             ("ours", "zbv timed"): (0.9, 0.8, 0.78),
             ("torch", "zb-h1"): (1.1, 1.0, 0.8), ("torch", "zbv"): (1.0, 0.9, 0.8),
             ("torch", "1f1b"): (1.2, 1.1, 0.8), ("ours", "1f1b"): (1.15, 1.05, 0.75)}
    runs = {job: [_zero_bubble_run(*steps[job], fused if job[1] == "1f1b" else passes)]
            for job in JOBS}
    rec = summarize(runs, 4, ["1,1.3,1"])
    assert rec["speedup"]["zbv"]["torch 1f1b"] == [pytest.approx(1.2 / 0.95)]
    assert rec["speedup"]["zb-h1"]["torch zb-h1"] == [pytest.approx(1.1 / 1.05)]
    assert rec["speedup"]["zbv timed"]["torch zbv"] == [pytest.approx(1.0 / 0.9)]
    assert rec["zbv_timed_pass_times"] == ["1,1.3,1"]
    # Without bubble: optimizer (step - pipe = 0.1) + busiest compute (0.8).
    assert ideal_step(runs[("ours", "zbv")][0]) == pytest.approx(0.9)
    assert rec["ceiling"]["zbv"] == [pytest.approx(1.2 / 0.9)]
    assert rec["ceiling"]["free split"] == [pytest.approx(1.2 / 0.85)]
    assert rec["ceiling"]["split cost"] == [pytest.approx(0.8 / 0.75)]
    assert rec["bubble"]["zb-h1"]["predicted"] == [pytest.approx(1 / 13)]
    # The timed zbv's prediction plays the order built for its times, not the equal one.
    assert rec["bubble"]["zbv timed"]["predicted"][0] != \
        pytest.approx(rec["bubble"]["zbv"]["predicted"][0])
    assert rec["bubble"]["1f1b"]["predicted"] == [pytest.approx(1 / 5)]
    assert rec["bubble"]["zb-h1"]["measured"] == [pytest.approx(1 - 0.8 / 0.9)]
    met = targets_met([rec])
    assert met["zbv vs torch 1f1b"] is True and met["zb-h1 vs torch 1f1b"] is False
    assert met["zb-h1 vs torch zb-h1"] is True

    from perf.render_parallel import render_zero_bubble
    memory = {kind: {"act_bytes": [2**20 * n, 2**20], "held": held_per_stage(kind, 8),
                     "vs_1f1b": n / 2, "predicted_vs_1f1b": 1.5 if kind != "1f1b" else 1.0}
              for kind, n in (("1f1b", 2), ("zb-h1", 3), ("zbv", 3))}
    assert memory["zb-h1"]["held"] == [3, 2] and memory["zbv"]["held"] == [3, 3]
    text = "\n".join(render_zero_bubble({"rounds": 1, "records": [rec], "met": met,
                                          "memory": memory, "memory_m": 8}))
    assert "| zbv | 3.000 / 1.000 | 3.000 / 3.000 | 1.500 | 1.500 |" in text
    assert "| 2 | 4 | zbv | torch 1f1b | 950 | 1,200 | 1.263 | 1.200x met |" in text
    assert "| 2 | 4 | zb-h1 | torch 1f1b | 1,050 | 1,200 | 1.143 | 1.200x MISSED |" \
        in text
    assert "| 2 | 4 | zb-h1 | 0.111 | 0.077 | 0.077 |" in text
    assert "zb-h1 vs torch 1f1b missed" in text


def test_seed_checks_notice_a_seed_that_changes_nothing():
    def run(seed, loss, init, crc):
        base = {"loss_step10": loss, "init_checksum": init, "first_batch_crc32": crc}
        return {"seed": seed, "hpctrain_dp2": {"loss_step10": loss},
                "baseline_matched": dict(base), "nanogpt_style_1proc_2threads": dict(base)}

    checks = seed_checks([run(1, 3.1, 10.0, 5), run(2, 3.2, 11.0, 6)])
    assert all(v is True for c in checks.values() for v in c.values())
    same_data = seed_checks([run(1, 3.1, 10.0, 5), run(2, 3.2, 11.0, 5)])
    assert same_data["baseline_matched"]["data_differs"] is False
    assert seed_checks([run(1, 3.1, 10.0, 5)])["hpctrain_dp2"]["loss_step10_differs"] is None


def test_missing_shakespeare_names_where_to_get_it(monkeypatch, tmp_path):
    monkeypatch.delenv("HPCTRAIN_SHAKESPEARE", raising=False)
    with pytest.raises(SystemExit, match="--shakespeare PATH.*HPCTRAIN_SHAKESPEARE") as e:
        shakespeare_text(None)
    assert "karpathy/char-rnn" in str(e.value) and "input.txt" in str(e.value)
    with pytest.raises(SystemExit, match="does not exist"):
        shakespeare_text(tmp_path / "nope.txt")
    text = tmp_path / "input.txt"
    text.write_text("a few words of text\n")
    monkeypatch.setenv("HPCTRAIN_SHAKESPEARE", str(text))
    assert shakespeare_text(None) == text.resolve()


def test_longest_under_doubles_then_bisects_to_the_step():
    for limit, want in [(300, 0), (1000, 512), (1024, 1024), (9000, 8704), (20000, 16384)]:
        probes = []
        got = longest_under(lambda t: probes.append(t) or t <= limit, 1024, 16384, 512)
        assert got == want, limit
        assert len(probes) == len(set(probes)) and all(t % 512 == 0 for t in probes)
        assert max(probes) <= 16384


def test_long_context_section_renders_the_sweep_and_the_capacity(tmp_path):
    def rec(variant, seq, mib, ms):
        return {"variant": variant, "seq": seq, "peak_bytes": mib * 2**20, "step_ms_all": ms}

    d = {"git_sha": "abc1234", "tree_clean": True, "time": "2026-01-01T00:00:00",
         "machine": {}, "model": {"n_layer": 2, "n_embd": 256, "n_head": 4, "n_kv_head": 2,
                                  "vocab_size": 32000, "tie_embeddings": False},
         "loss_chunk": 1024, "dtype": "fp32", "threads": 2,
         "sweep": [rec("plain", 1024, 400, [2.0, 1.0, 3.0]), rec("chunked", 1024, 200, [4.0])],
         "capacity": {"cap_bytes": 400 * 2**20, "cap_from": "the plain head's peak at 1024",
                      "search_step": 512, "max_t": 4096,
                      "by_variant": {"plain": {"longest": 1024, "at_limit": False,
                                               "vs_plain": 1.0},
                                     "chunked": {"longest": 4096, "at_limit": True,
                                                 "vs_plain": 4.0}}},
         "target": 2.0, "ratio": 4.0, "met": True}
    (tmp_path / "long_context.json").write_text(json.dumps(d))
    doc = make_results.render(tmp_path)
    assert "| 1024 | 400 | 2.000 [1.000, 3.000] | 200 | 4.000 | 2.000 |" in doc
    assert "| chunked | >= 4096 | 4.000 |" in doc
    assert "4.000x -> met." in doc


def test_memory_section_renders_each_variant_against_reference_and_formula(tmp_path):
    gib = 2**30

    def rec(variant, chunk, step, vs_ref):
        return {"variant": variant, "head_chunk": chunk, "state_bytes": 6 * gib,
                "step_peak_bytes": step * gib, "optimizer_peak_bytes": 0.5 * gib,
                "peak_bytes": (6 + step) * gib, "formula": {"peak_bytes": 8 * gib},
                "vs_reference": vs_ref, "step_vs_reference": vs_ref, "vs_formula": 1.0,
                "step_vs_formula": 1.0}

    d = {"git_sha": "abc1234", "tree_clean": True, "time": "2026-01-01T00:00:00",
         "machine": {}, "shape": {"n_layer": 24, "n_embd": 1024, "n_head": 16,
                                  "vocab_size": 50257, "block_size": 2048},
         "rows": 1, "dtype": "fp32",
         "variants": [rec("reference", None, 4, 1.0), rec("default", 1335, 2, 0.8)],
         "published": {"rows": 8, "whole_bytes": 6 * gib, "default_bytes": 0.5 * gib}}
    (tmp_path / "memory.json").write_text(json.dumps(d))
    doc = make_results.render(tmp_path)
    assert ("| default | 1335 tokens | 6.000 | 2.000 | 0.500 | 8.000 | 8.000 | 0.800 | "
            "0.800 | 1.000 | 1.000 |") in doc
    assert "6.000 GiB whole, 0.500 GiB with the automatic head" in doc
