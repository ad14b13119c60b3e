"""``--train.tensorboard``: the same scalars as ``metrics.jsonl``, under grouped tags
(``train/loss``, ``perf/mfu``...), read back with TensorBoard's own reader (the ``report``
leg, which installs the package), and a clear refusal before anything is written when the
package is missing."""

import json
import sys

import pytest
from mpi4py import MPI

from hpctrain.errors import ConfigError
from hpctrain.train.tensorboard import NOT_SCALARS, TAGS, ScalarLog, tag, tensorboard_dir
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config


def test_the_setting_names_the_folder(tmp_path):
    assert tensorboard_dir("false", tmp_path) is None
    assert tensorboard_dir("true", tmp_path) == tmp_path / "tensorboard"
    assert tensorboard_dir(str(tmp_path / "tb"), "runs/x") == tmp_path / "tb"


def test_without_the_package_training_is_refused_before_anything_is_written(
        dataset_path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # an import of it fails
    cfg = tiny_config(dataset_path, tmp_path / "run", **{"train.tensorboard": "true"})
    with pytest.raises(ConfigError, match=r"pip install tensorboard"):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert not (tmp_path / "run").exists()


def test_every_field_a_run_records_has_a_group(dataset_path, tmp_path):
    """Each number a run writes to metrics.jsonl (training, validation, the final
    evaluation) is shown under a named group, none under ``other/``; the groups are the
    sections TensorBoard and W&B draw."""
    cfg = tiny_config(dataset_path, tmp_path, **{"train.eval_interval": 5,
                                                 "train.eval_iters": 1,
                                                 "train.final_eval": True})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    fields = {key for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              for key in json.loads(line)} - set(NOT_SCALARS)
    assert {"loss", "val_loss", "final_val_loss", "mfu", "tokens_per_s"} <= fields
    assert fields <= TAGS.keys(), fields - TAGS.keys()
    assert {tag(k).split("/")[0] for k in fields & TAGS.keys()} <= {
        "train", "val", "perf", "time"}
    assert tag("loss") == "train/loss" and tag("val_loss") == "val/loss"
    assert tag("mfu") == "perf/mfu" and tag("tokens_per_s") == "perf/tokens_per_s"
    assert tag("peak_rss_bytes") == "memory/peak_rss_bytes" and tag("x") == "other/x"


class RecordingWriter:
    """Stands in for ``SummaryWriter``: what was called, in order."""

    def __init__(self, **kwargs):
        self.calls = [("open", kwargs["log_dir"])]

    def add_scalar(self, tag, value, global_step):
        self.calls.append((tag, value, global_step))

    def flush(self):
        self.calls.append("flush")

    def close(self):
        self.calls.append("close")


def test_each_record_is_flushed_and_the_end_closes(tmp_path):
    log = ScalarLog(tmp_path, RecordingWriter)
    writer = log._writer
    log.write({"step": 5, "loss": 2.5, "mfu": None, "lr": float("nan"), "elapsed_s": 1.0,
               "started_at": 9.0, "start_step": 0, "skipped_steps": 0})
    log.write({"step": 10, "final_val_loss": 2.0})
    log.close()
    log.close()  # a second close (an error after the end) does nothing
    assert writer.calls == [("open", str(tmp_path)), ("train/loss", 2.5, 5),
                            ("time/elapsed_s", 1.0, 5), ("train/skipped_steps", 0, 5), "flush",
                            ("val/final_loss", 2.0, 10), "flush", "close"]
    ScalarLog(None).write({"step": 1, "loss": 1.0})  # other ranks: nothing, no package


def _events(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


@pytest.mark.report
def test_scalars_are_on_disk_at_every_log_interval_before_close(tmp_path):
    log = ScalarLog(tmp_path / "tb")
    log.write({"step": 5, "loss": 2.5, "mfu": None, "started_at": 1.0, "start_step": 0})
    assert _events(tmp_path / "tb") == {"train/loss": [(5, 2.5)]}  # flushed, not yet closed
    log.write({"step": 10, "loss": 2.25})
    log.close()
    assert _events(tmp_path / "tb") == {"train/loss": [(5, 2.5), (10, 2.25)]}


@pytest.mark.report
def test_a_resumed_log_drops_the_earlier_attempts_later_steps(tmp_path):
    """Killed at step 15 after its checkpoint of step 10: the resumed run's events replace
    the first attempt's 15, as metrics.jsonl's records do."""
    first = ScalarLog(tmp_path / "tb")
    for step, loss in ((5, 3.0), (10, 2.5), (15, 2.4)):
        first.write({"step": step, "loss": loss})
    first.close()
    resumed = ScalarLog(tmp_path / "tb", resumed_at=10)
    resumed.write({"step": 15, "loss": 2.25})
    resumed.close()
    assert _events(tmp_path / "tb") == {"train/loss": [(5, 3.0), (10, 2.5), (15, 2.25)]}


@pytest.mark.report
def test_the_events_hold_what_metrics_jsonl_holds(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{
        "train.tensorboard": "true", "train.max_iters": 20, "train.eval_interval": 10,
        "train.eval_iters": 2, "train.final_eval": True})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    want: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for key, value in r.items():
            if key not in ("step", "started_at", "start_step") and value is not None:
                want.setdefault(tag(key), []).append((r["step"], value))
    got = _events(tmp_path / "tensorboard")
    assert {"train/loss", "val/loss", "val/final_loss", "perf/tokens_per_s",
            "time/elapsed_s"} <= got.keys()
    assert got.keys() == want.keys()
    for name, points in want.items():
        assert [s for s, _ in got[name]] == [s for s, _ in points], name
        assert [v for _, v in got[name]] == pytest.approx([v for _, v in points], rel=1e-6), name
