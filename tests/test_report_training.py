"""The report on what training really writes: a run stopped part-way, resumed from an
older checkpoint, then drawn (the records' segment fields, ``memory_by_rank``)."""

import json

import pytest
from mpi4py import MPI

from hpctrain.report.page import build_report
from hpctrain.report.runs import read_run
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config

pytestmark = pytest.mark.slow


def _fit(cfg):
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()


def test_a_run_resumed_from_an_older_checkpoint_is_joined(dataset_path, tmp_path):
    common = {"train.ckpt_interval": 10, "train.save_checkpoint": True,
              "train.log_interval": 5}
    _fit(tiny_config(dataset_path, tmp_path, **common, **{"train.max_iters": 20}))
    _fit(tiny_config(dataset_path, tmp_path, **common, **{
        "train.max_iters": 30, "train.resume": str(tmp_path / "checkpoints/step_000010")}))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # One history: the first run's records past step 10 were set aside, not deleted.
    assert [(r["step"], r["start_step"]) for r in lines] == [
        (5, 0), (10, 0), (15, 10), (20, 10), (25, 10), (30, 10)]
    (moved,) = tmp_path.glob("previous-*/metrics.jsonl")  # beside the abandoned step 20
    assert [json.loads(x)["step"] for x in moved.read_text().splitlines()] == [15, 20]
    run = read_run(tmp_path)
    assert run.segments == 2
    assert [(r["step"], r["segment"]) for r in run.records] == [
        (5, 0), (10, 0), (15, 1), (20, 1), (25, 1), (30, 1)]
    walls = [r["wall_s"] for r in run.records]
    first_end = lines[1]["elapsed_s"]
    assert walls == sorted(walls) and walls[2] == pytest.approx(first_end
                                                                 + lines[2]["elapsed_s"])
    assert len(run.summary["memory_by_rank"]) == 1
    assert run.summary["memory_by_rank"][0]["peak_rss_bytes"] == \
        run.summary["peak_rss_bytes_max_rank"] > 0
    page = build_report([tmp_path])
    assert page.read_text().count("data:image/png;base64,") == 5
