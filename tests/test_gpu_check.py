"""``perf/gpu_check.py``'s own logic, without a GPU: the budget and the time limits, the
verdict table, ``--only``, a timed-out launch ended with its process group, the FP8 loss
comparison, and the measured peak against the memory formula."""

import json
import os
import sys
import time

import pytest

from hpctrain.comm.device import Accelerator
from hpctrain.config import load_config
from hpctrain.scaling.arrangement import Arrangement
from hpctrain.scaling.models import ModelShape
from hpctrain.scaling.rank_memory import rank_memory_terms
from perf import gpu_check, gpu_rows
from perf.common import run
from perf.gpu_runs import Context, device_peak_gib, formula_terms
from perf.gpu_verdict import (FAILED, NOT_POSSIBLE, SKIPPED, Check, parse_only,
                              verdict_table)


def test_a_step_is_recorded_whatever_happens_and_the_budget_ends_the_check(tmp_path):
    check = Check(budget_s=100, limits={"a": 30, "b": 500, "c": 50})
    ctx = Context(device="fake", dry=True, gpt2=tmp_path, small=tmp_path, out=tmp_path)
    seen = {}

    def a(c):
        seen["a"] = c.deadline - time.monotonic()
        raise RuntimeError("broken")

    def b(c):
        seen["b"] = c.left()
        check.budget_s = 0  # this step spent the rest of the budget
        return {"key": "x", "goal": "g", "met": False}

    check.step("a", a, ctx)
    check.step("b", b, ctx)
    check.step("c", lambda c: pytest.fail("a step past the budget ran"), ctx)
    s = check.sections
    assert s["a"]["status"] == FAILED and "RuntimeError: broken" in s["a"]["error"]
    assert 25 < seen["a"] <= 30  # its own limit
    assert 90 < seen["b"] <= 100  # the budget's end, before its limit of 500
    assert s["b"]["status"] == "ok" and s["c"]["status"] == SKIPPED
    assert check.failed == ["a", "c"]


def test_the_verdict_table_gives_each_step_its_number_goal_and_whether_met():
    table = verdict_table({
        "gpt2_124m": {"status": "ok", "key": "MFU 52.0%", "goal": "MFU >= 0.50", "met": True},
        "llama_1b": {"status": "ok", "key": "MFU 40.0%", "goal": "MFU >= 0.45", "met": False},
        "fp8": {"status": NOT_POSSIBLE, "why": "FP8 needs compute capability 8.9\nmore"},
        "doctor": {"status": FAILED, "error": "x" * 200}})
    lines = table.splitlines()
    assert lines[0].split() == ["step", "status", "key", "number", "goal", "met"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert rows["gpt2_124m"].endswith("yes") and rows["llama_1b"].endswith("NO")
    assert "FP8 needs compute capability 8.9" in rows["fp8"] and "more" not in rows["fp8"]
    assert rows["doctor"].count("x") < 80 and "..." in rows["doctor"]


def test_only_names_steps_that_exist():
    steps = ["doctor", "fp8"]
    assert parse_only(None, steps) == steps and parse_only("fp8", steps) == ["fp8"]
    with pytest.raises(SystemExit, match="unknown step.*fp16.*doctor, fp8"):
        parse_only("fp8,fp16", steps)


def test_the_steps_fit_the_budget_and_each_has_a_limit():
    args = type("A", (), {"dry_run": False, "steps": 40})
    assert set(gpu_check.steps(args)) | {"environment"} == set(gpu_check.LIMITS)
    assert gpu_check.BUDGET_S <= 9 * 60


def test_a_timed_out_launch_is_ended_with_every_process_it_started(tmp_path):
    pid_file = tmp_path / "child"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    rc, out = run(["bash", "-c", script], timeout=1)
    assert rc == 124 and "timed out" in out
    child = int(pid_file.read_text())
    for _ in range(50):  # reaped by init soon after the kill
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the launch's child {child} outlived the timeout")
    assert run([sys.executable, "-c", "print('hi')"], timeout=0)[0] == 124


def test_fp8_loss_gap_is_the_mean_over_the_last_steps_both_logged():
    bf16 = {s: 10.0 - s / 100 for s in range(5, 201, 5)}
    fp8 = {s: v + (0.03 if s > 150 else 0.5) for s, v in bf16.items()}
    gap = gpu_rows.loss_gap(fp8, bf16, 50)
    assert gap["steps_compared"] == 10 and gap["mean_gap"] == pytest.approx(0.03)
    assert gap["max_step_gap"] == pytest.approx(0.5) and not gap["identical"]
    assert gap["mean_gap"] <= gpu_rows.FP8_LOSS_BOUND
    assert gpu_rows.loss_gap(bf16, dict(bf16), 50)["identical"]
    assert gpu_rows.loss_gap({}, bf16, 50)["mean_gap"] is None


def test_the_device_peak_is_read_from_the_trainers_memory_line():
    class Device(Accelerator):
        def memory_stats(self):
            return {"allocated": 2 << 30, "peak": int(11.38 * (1 << 30)), "reserved": 12 << 30}

    line = f"memory per rank: params 1 MiB; {Device().describe_memory()}"
    assert device_peak_gib(line) == 11.38
    assert device_peak_gib("memory per rank: params 1 MiB") is None


def test_the_formula_for_a_run_is_the_performance_models_for_its_config(tmp_path):
    cfg = load_config("llama-1b", ["--model.vocab_size=50257"]).to_dict()
    terms = formula_terms(cfg, 1, tmp_path / "unused.h5")
    shape = ModelShape(**{k: cfg["model"][k] for k in ModelShape.__dataclass_fields__
                          if k in cfg["model"]})
    assert terms == rank_memory_terms(shape, Arrangement(
        ranks=1, micro_batches=32, global_batch=256, dtype="bf16", loss_chunk=-1))
    assert terms["model_state"] == 18 * shape.params  # bf16 + fp32 grads, master, moments
    long = load_config("llama-1b", ["--model.vocab_size=50257", "--model.block_size=16384",
                                    "--model.recompute=block", "--model.loss_chunk=4096",
                                    "--train.batch_size=1", "--parallel.micro_batches=1"])
    saved = formula_terms(long.to_dict(), 1, tmp_path / "unused.h5")
    assert saved["activations"] < terms["activations"] / 4
    assert saved["logits"] < terms["logits"] / 2
    json.dumps(terms)  # what the result file stores


def test_fp8_refused_by_the_device_is_not_possible_and_any_other_refusal_fails(
        monkeypatch, tmp_path):
    ctx = Context(device="cuda", dry=False, gpt2=tmp_path, small=tmp_path, out=tmp_path)
    refusal = {"status": FAILED, "exit": 2, "tail": ""}
    monkeypatch.setattr(gpu_rows, "train", lambda *a, **k: {
        **refusal, "refusal": "error: --train.fp8=true needs a GPU with FP8 units"})
    section = gpu_rows.fp8(ctx)
    assert section == {"status": NOT_POSSIBLE,
                       "why": "error: --train.fp8=true needs a GPU with FP8 units"}
    monkeypatch.setattr(gpu_rows, "train", lambda *a, **k: {
        **refusal, "refusal": "error: unknown option --train.nope"})
    assert gpu_rows.fp8(ctx)["status"] == FAILED


def test_the_trace_step_keeps_each_ranks_summary_and_clock(monkeypatch, tmp_path):
    ctx = Context(device="fake", dry=True, gpt2=tmp_path, small=tmp_path, out=tmp_path)
    seen = {}

    def train(ctx, name, recipe, overrides, **kw):
        seen["overrides"] = overrides
        return {"status": "ok", "run_dir": str(tmp_path / name), "phases_ms": {"step": 9.0},
                "clock": "device events", "step_ms_median": 9.0}

    top = [{"name": f"kernel{i}", "ms": 20 - i, "count": 1, "share": (20 - i) / 300}
           for i in range(10)]
    summary = {"source": "device", "steps": 2, "span_ms": 40.0, "busy_ms": 30.0,
               "idle_share": 0.25, "top": top, "phases_ms": {"forward": 3.0}}
    monkeypatch.setattr(gpu_rows, "summarize_run_traces", lambda run_dir: {0: summary}
                        if run_dir == tmp_path / "trace" else {})
    monkeypatch.setattr(gpu_rows, "train", train)
    section = gpu_rows.trace(ctx)
    assert any(o.startswith("--train.profile=") for o in seen["overrides"])
    assert section["ranks"]["0"] == summary
    assert section["clock"] == "device events" and "idle 25%" in section["key"]
    monkeypatch.setattr(gpu_rows, "summarize_run_traces", lambda run_dir: {})
    assert gpu_rows.trace(ctx)["status"] == FAILED  # profiled, yet no trace: a finding


def test_the_environment_step_names_the_gpu_its_count_and_memory(monkeypatch, tmp_path):
    import types

    import torch

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(total_memory=150_117_646_336))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    ctx = Context(device="cuda", dry=False, gpt2=tmp_path, small=tmp_path, out=tmp_path)
    env = gpu_check.environment(ctx)
    assert (env["name"], env["count"], env["memory_gib"], env["nccl"]) == (
        "NVIDIA H200", 1, 139.8, "2.28.9")
    assert "status" not in env and env["key"].startswith("1 x NVIDIA H200")
    monkeypatch.setattr(torch, "__version__", "2.11.0+cpu")
    assert gpu_check.environment(ctx)["status"] == FAILED


def test_results_md_renders_the_verdict_of_a_check_that_writes_one():
    from perf.make_results import render_gpu

    env = {"device": "cuda", "name": "GPU", "torch": "2.11", "mpi": "MPI"}
    new = {"environment": {**env, "status": "ok", "key": "GPU"},
           "fp8": {"status": NOT_POSSIBLE, "key": "no FP8 units", "goal": "gap <= 0.05",
                   "met": None}}
    text = "\n".join(render_gpu({"sections": new}))
    assert "| fp8 | not possible | no FP8 units | gap <= 0.05 | - |" in text
    old = {"environment": {**env, "status": "ok"}}  # a check from before the verdicts
    assert "| step | status |" not in "\n".join(render_gpu({"sections": old}))


def test_an_fp8_llama_run_cut_by_the_budget_is_a_step_to_rerun_not_a_finding(
        monkeypatch, tmp_path):
    ctx = Context(device="cuda", dry=False, gpt2=tmp_path, small=tmp_path, out=tmp_path)
    ctx.sections = {}
    gpt2 = {"status": "ok", "losses": {i: 5.0 for i in range(1, 201)},
            "tokens_per_s": 1.0}

    def train(ctx, name, recipe, overrides, **kw):
        if recipe == "llama-1b":
            return {"status": FAILED, "exit": 124, "error": "timed out", "timed_out": True}
        return dict(gpt2)

    monkeypatch.setattr(gpu_rows, "train", train)
    section = gpu_rows.fp8(ctx)
    assert section["status"] == SKIPPED and "out of time" in section["why"]
    monkeypatch.setattr(gpu_rows, "train", lambda ctx, name, recipe, *a, **k: (
        {"status": FAILED, "exit": 1, "error": "exit 1"} if recipe == "llama-1b"
        else dict(gpt2)))
    assert gpu_rows.fp8(ctx)["status"] == FAILED
