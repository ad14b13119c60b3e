"""``hpctrain plan`` as users ask it: fixed layouts, any model shape, system folders, one
warning per missing perf table, context parallelism for long sequences, labelled
throughput. One process; predictions are arithmetic (no torch work, no MPI)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from hpctrain.checkpoint.hf_config import to_hf_config
from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR, UserError
from hpctrain.scaling import context_cost
from hpctrain.scaling import perfmodel as pm
from hpctrain.scaling.models import parse_shape, preset_shape
from hpctrain.scaling.planner import Fixed, plan, table
from hpctrain.scaling.system_perf import load_perf

POLARIS = Path(__file__).resolve().parents[1] / "hpctrain" / "systems" / "polaris.toml"


def _plan_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_fixed_layout_is_what_the_plan_returns():
    fixed = Fixed(tp=4, pp=2, zero=1, micro_batch=1, schedule="interleaved")
    p = plan(system="polaris", nodes=16, model="llama3-8b", fixed=fixed)
    assert p.fitting
    for c in p.fitting:
        a = c.arrangement
        assert (a.tp, a.pp, a.zero, a.micro_rows, a.schedule) == (4, 2, 1, 1, "interleaved")
    every = plan(system="polaris", nodes=16, model="llama3-8b",
                 fixed=Fixed(dp=8, tp=4, pp=2, cp=1, zero=1, micro_batch=2))
    assert {(c.arrangement.dp, c.arrangement.tp, c.arrangement.pp) for c in every.fitting} \
        == {(8, 4, 2)}
    assert "fixed: dp=8 tp=4 pp=2 cp=1 zero=1 micro-batch=2" in table(every)


@pytest.mark.parametrize("args, match", [
    (["--tp", "4", "--pp", "2", "--zero", "3"], "ZeRO 0 or 1"),
    (["--dp", "4", "--tp", "4", "--pp", "2", "--cp", "1"], "not the 64 ranks"),
    (["--tp", "3"], "divisor of the 4 ranks per node"),
    (["--dp", "7"], "must divide the 64 ranks"),
    (["--cp", "3"], "2 x 3 chunks"),
    (["--zero", "5"], "use 0, 1, 2 or 3"),
    (["--schedule", "fast"], "use one of"),
    (["--micro-batch", "3", "--dp", "64"], "no legal arrangement"),
    (["--pp", "32", "--schedule", "interleaved"], "do not split into 64"),
    (["--pp", "1", "--schedule", "zbv"], "needs --pp 2 or more"),
])
def test_an_impossible_fixed_layout_is_refused_once_naming_why(capsys, args, match):
    code, out, err = _plan_cli(capsys, "--system", "polaris", "--nodes", "16", "--model",
                               "llama3-8b", *args)
    assert code == EXIT_USER_ERROR and out == ""
    assert match in err and len(err.strip().splitlines()) == 1


def test_shape_gives_any_model_and_bad_shapes_get_one_message(capsys):
    s = parse_shape("n_layer=32,n_embd=4096,n_head=32,n_kv_head=8,ffn=14336,vocab=128256",
                    seq_len=8192)
    assert s.arch == "llama" and s.params == preset_shape("llama3-8b").params
    assert parse_shape("n_layer=12,n_embd=768,n_head=12,vocab=50304").arch == "gpt"
    code, out, _ = _plan_cli(capsys, "--system", "polaris", "--nodes", "2", "--shape",
                             "n_layer=12,n_embd=768,n_head=12,vocab=50304,seq=1024", "--top", "1")
    assert code == 0 and "shape L12 C768" in out
    for bad, match in (("n_layer=32,width=4096", "keys among"), ("n_layer=abc", "whole number"),
                       ("n_layer=32,n_embd=4096", "lacks n_head, vocab"),
                       ("n_layer=2,n_embd=100,n_head=3,vocab=10", "not a multiple")):
        code, out, err = _plan_cli(capsys, "--system", "polaris", "--nodes", "1", "--shape", bad)
        assert code == EXIT_USER_ERROR and match in err and len(err.strip().splitlines()) == 1
    code, _, err = _plan_cli(capsys, "--system", "polaris", "--nodes", "1")
    assert code == EXIT_USER_ERROR and "--shape" in err


def test_a_hugging_face_config_and_a_model_toml_are_models(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(to_hf_config(preset_shape("llama3-8b").gpt.shape())))
    code, out, _ = _plan_cli(capsys, "--system", "polaris", "--nodes", "16", "--model",
                             str(cfg), "--top", "1")
    assert code == 0 and "8.03B parameters" in out
    toml = tmp_path / "tiny.toml"
    toml.write_text("[model]\nn_layer = 4\nn_head = 4\nn_embd = 256\nblock_size = 512\n"
                    "vocab_size = 1000\n")
    assert _plan_cli(capsys, "--system", "polaris", "--nodes", "1", "--model", str(toml))[0] == 0
    toml.write_text("n_layer = 4\nlayers = 2\n")
    code, _, err = _plan_cli(capsys, "--system", "polaris", "--nodes", "1", "--model", str(toml))
    assert code == EXIT_USER_ERROR and "unknown key(s) layers" in err


def test_system_may_be_a_folder_holding_one_file(tmp_path, capsys):
    shutil.copy(POLARIS, tmp_path / "polaris.toml")
    code, out, _ = _plan_cli(capsys, "--system", str(tmp_path), "--nodes", "1", "--model",
                             "gpt2", "--top", "1")
    assert code == 0 and "polaris" in out
    shutil.copy(POLARIS, tmp_path / "other.toml")
    code, _, err = _plan_cli(capsys, "--system", str(tmp_path), "--nodes", "1", "--model", "gpt2")
    assert code == EXIT_USER_ERROR and "other.toml, polaris.toml" in err


def test_a_missing_table_gets_one_warning_naming_it(tmp_path, capsys):
    text = POLARIS.read_text()
    text = text.replace("memory_gbytes_per_s = 1555.0\n", "")
    text = text[:text.index("[perf.network.xccl]")]
    f = tmp_path / "bare.toml"
    f.write_text(text)
    code, _, err = _plan_cli(capsys, "--system", str(f), "--nodes", "1", "--model", "gpt2",
                             "--top", "1")
    assert code == 0
    lines = [x for x in err.splitlines() if x.startswith("warning:")]
    assert len(lines) == 2
    assert "memory_gbytes_per_s" in lines[0] and "whole forward + backward rate" in lines[0]
    assert "[perf.network.xccl]" in lines[1] and "MPI links" in lines[1]
    again = _plan_cli(capsys, "--system", str(f), "--nodes", "1", "--model", "gpt2")[2]
    assert "warning" not in again  # once per file and key
    assert _plan_cli(capsys, "--system", "polaris", "--nodes", "1", "--model", "gpt2")[2] == ""


def test_an_achieved_rate_above_the_peak_is_refused(tmp_path):
    f = tmp_path / "fast.toml"
    f.write_text(POLARIS.read_text().replace("bf16 = 210.0", "bf16 = 400.0"))
    with pytest.raises(UserError, match="above the A100 peak"):
        load_perf(str(f))


def test_long_sequences_get_context_parallel_layouts(capsys):
    p = plan(system="polaris", nodes=16, model="llama3-8b", seq_len=131072)
    assert p.fitting and all(c.arrangement.cp > 1 for c in p.fitting)
    short = plan(system="polaris", nodes=16, model="llama3-8b")
    assert all(c.arrangement.cp == 1 for c in short.fitting)  # cp only when needed
    code, out, _ = _plan_cli(capsys, "--system", "polaris", "--nodes", "16", "--model",
                             "llama3-8b", "--seq", "131072", "--top", "1", "--explain")
    assert code == 0 and "context-parallel ring" in out and " cp=" in out


def test_context_parallelism_divides_activations_and_logits():
    shape, sys_ = preset_shape("llama3-8b", block_size=32768), load_perf("polaris")
    # the whole head (-1): the automatic chunk would hold the same chunk's logits in both
    one = pm.Arrangement(ranks=64, tp=4, sequence_parallel=True, global_batch=16, dtype="bf16",
                         loss_chunk=-1)
    four = dataclasses.replace(one, cp=4, micro_batches=4)  # the same rows per micro-batch
    assert (one.micro_rows, four.micro_rows) == (1, 1)
    t1, t4 = pm.predict_memory(sys_, shape, one)[1], pm.predict_memory(sys_, shape, four)[1]
    assert t4["activations"] == pytest.approx(t1["activations"] / 4)
    assert t4["logits"] == pytest.approx(t1["logits"] / 4)


def test_gradients_are_reduced_and_sharded_over_dp_times_cp():
    shape, sys_ = preset_shape("llama3-8b", block_size=32768), load_perf("polaris")
    base = pm.Arrangement(ranks=64, tp=4, sequence_parallel=True, global_batch=16, dtype="bf16",
                          zero=1)
    cp4 = dataclasses.replace(base, cp=4)
    assert (base.dp, cp4.dp, cp4.grad_group) == (16, 4, 16)
    assert pm.predict_memory(sys_, shape, cp4)[1]["model_state"] == pytest.approx(
        pm.predict_memory(sys_, shape, base)[1]["model_state"])


def test_the_ring_sends_kv_blocks_cp_minus_one_times_and_hides_behind_attention():
    shape = preset_shape("llama3-8b", block_size=65536)
    sent = []

    def step(n):
        sent.append(n)
        return n / 10e9

    exposed, total = context_cost.ring_times(step, shape, 1, "bf16", cp=4, tp=1, layers=2,
                                             flops_per_s=200e12)
    block = 2 * 1 * (65536 / 4) * 8 * 128 * 2  # k and v, s/cp tokens, 8 kv heads of 128, bf16
    assert sent == [block, 2 * block]
    assert total == pytest.approx(2 * 3 * (3 * block) / 10e9)
    attention = 12 * 4096 * 65536 * 65536 / 4 / 200e12
    assert exposed == pytest.approx(2 * max(0.0, 3 * 3 * block / 10e9 - attention))
    slow = context_cost.ring_times(lambda n: n / 1e8, shape, 1, "bf16", 4, 1, 2, 200e12)
    assert slow[0] > 0 and exposed == 0.0


def test_tokens_per_second_are_labelled_job_and_per_gpu(capsys):
    p = plan(system="polaris", nodes=4, model="gpt2-xl")
    text = table(p, top=1)
    assert "job tok/s" in text and "GPU tok/s" in text and "whole job" in text
    q = p.fitting[0].prediction
    assert f"{q.tokens_per_s:,.0f}" in text and f"{q.tokens_per_s / 16:,.0f}" in text


def test_selective_and_every_other_block_recomputation():
    shape, sys_ = preset_shape("gpt3-2.7b"), load_perf("polaris")
    arr = pm.Arrangement(ranks=4, global_batch=4, dtype="bf16")
    mem = {r: pm.predict_memory(sys_, shape, dataclasses.replace(arr, recompute=r))[1]
           ["activations"] for r in ("none", "selective", "block")}
    half = pm.predict_memory(sys_, shape, dataclasses.replace(arr, recompute_every=2))[1][
        "activations"]
    assert mem["block"] < mem["selective"] < mem["none"]
    assert mem["block"] < half < mem["none"]
    step = {r: pm.predict(sys_, shape, dataclasses.replace(arr, recompute=r)).compute_s
            for r in ("none", "selective", "block")}
    assert step["none"] <= step["selective"] < step["block"]
    with pytest.raises(UserError, match="block recomputes every block"):
        plan(system="polaris", nodes=1, model="gpt2", recompute="block", recompute_every=2)


def test_the_405b_preset_plans_on_aurora():
    p = plan(system="aurora", nodes=128, model="llama3-405b", recompute="block",
             fixed=Fixed(tp=4, zero=1))
    assert p.fitting and p.shape.params == pytest.approx(405.85e9, rel=1e-3)


def test_the_published_runs_are_cited_and_megatron_flops_convert():
    import tomllib

    from perf.bench_perfmodel import RUNS, megatron_flops_per_token, published_tokens

    runs = tomllib.loads(RUNS.read_text())["run"]
    assert len(runs) >= 40 and len({r["source"] for r in runs}) >= 4
    assert all(r["citation"] and r["url"].startswith("https://") for r in runs)
    assert len({r["id"] for r in runs}) == len(runs)
    # Narayanan et al. eq. 3 for the 1T model: 163 TFLOP/s per GPU is about 20 tokens/s.
    one_t = next(r for r in runs if r["id"] == "megatron-t1-1008b")
    assert megatron_flops_per_token(128, 25600, 2048, 51200) == pytest.approx(
        96 * 128 * 25600 ** 2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))
    assert published_tokens(one_t) == pytest.approx(19.96, abs=0.01)


def test_a_study_record_holds_the_shape_fields_once_counts_are_cached(tmp_path):
    """The shape's counts are cached on the object (the planner asks for them thousands
    of times); a study's record stores its fields only, as JSON."""
    from hpctrain.scaling.runner import new_record
    from tests.test_scaling_study import SPEC, _write
    from hpctrain.scaling.spec import load_study

    study = load_study(_write(tmp_path, SPEC.format(scaling="weak", batch="per_rank = 4")))
    point = study.points[0]
    assert point.model.params and point.model.gpt  # cached now
    rec = json.loads(json.dumps(new_record(study, point, 0, 0, ["x"])))
    assert set(rec["config"]["model"]) == set(point.model.fields()) | {"params"}
