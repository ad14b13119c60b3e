"""The benchmarks' single-process anchor (perf/nanogpt_baseline.py) runs: a few steps in
both modes, so a changed hpctrain API breaks a test here and not a 30-minute benchmark."""

import json
import sys

import pytest

from tests.helpers import REPO, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["nanogpt", "hpctrain"])
def test_nanogpt_baseline_trains_a_few_steps(dataset_path, tmp_path, mode):
    out = tmp_path / "baseline.json"
    p = run([sys.executable, str(REPO / "perf" / "nanogpt_baseline.py"), "--data",
             str(dataset_path), "--max-iters", "3", "--batch-size", "4", "--model",
             "1,1,16,16", "--no-eval", "--optimizer", mode, "--sampler", mode, "--eval", mode,
             "--out", str(out)], timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result, "the baseline wrote an empty result"
