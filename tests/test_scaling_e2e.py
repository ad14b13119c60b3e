"""``hpctrain scale run`` + ``report`` end to end with real ``mpiexec`` runs: a tiny
study at 1 and 2 ranks where one model cannot train (its vocabulary is smaller than the
data's), so that the failed points are recorded and the study goes on."""

from __future__ import annotations

import json

import pytest

from hpctrain.cli import main
from tests.helpers import launcher

pytestmark = pytest.mark.slow

SPEC = """
[study]
name = "e2e"
scaling = "weak"
ranks = [1, 2]
steps = 6
timeout_s = 120
overrides = ["--data.path={data}"]

[batch]
per_rank = 2

[[models]]
name = "ok"
n_layer = 1
n_head = 2
n_embd = 32
block_size = 16

[[models]]
name = "bad"
n_layer = 1
n_head = 2
n_embd = 32
block_size = 16
vocab_size = 5

[[parallel]]
name = "dp"
zero = 1
"""


def test_scale_run_and_report(tmp_path, dataset_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name, value in launcher().env().items():  # the study's own mpiexec runs (root)
        monkeypatch.setenv(name, value)
    spec = tmp_path / "e2e.toml"
    spec.write_text(SPEC.format(data=dataset_path))
    out = tmp_path / "out"
    assert main(["scale", "run", str(spec), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "[4/4]" in err and "2 run(s) ok, 2 failed" in err
    recs = {r.stem: json.loads(r.read_text()) for r in (out / "records").glob("*.json")}
    assert set(recs) == {"ok-dp-z1-pp1-m1-n1-r0", "ok-dp-z1-pp1-m1-n2-r0",
                         "bad-dp-z1-pp1-m1-n1-r0", "bad-dp-z1-pp1-m1-n2-r0"}
    good = recs["ok-dp-z1-pp1-m1-n2-r0"]
    assert good["status"] == "ok" and good["config"]["zero"] == 1
    m = good["measured"]
    assert m["world_size"] == 2 and m["step_ms_median"] > 0 and m["tokens_per_s"] > 0
    assert set(m["shares"]) == {"compute", "comm", "bubble", "data"}
    assert good["git"]["sha"] and good["environment"]["torch"]
    assert good["prediction"]["step_s"] > 0
    bad = recs["bad-dp-z1-pp1-m1-n1-r0"]
    assert bad["status"] == "failed" and "vocab" in bad["error"]

    assert main(["scale", "report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## Failed runs" in md and "ok / dp" in md
    assert (out / "plots" / "throughput.png").stat().st_size > 1000
