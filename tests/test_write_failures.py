"""No silent write failure (issue 29, item 4): a full disk or quota while writing
``metrics.jsonl``, ``final.h5`` or the output of ``ckpt merge | reshard | export`` is one
line and exit status 2, with no temporary left and any earlier output intact;
``metrics.jsonl`` holds whole lines only, and a torn last line is cut (with a warning)
when a run resumes, so that it never merges with the resumed run's first record.

The disk is a real full one where the tests may mount a tmpfs (``tests/full_disk.py``),
else the failure is injected at the OS call. The MPI-IO writes of ``prepare`` are
tested at 2 and 4 ranks in ``test_prepare_mpi.py``."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from mpi4py import MPI

from hpctrain.atomic import OutputError
from hpctrain.checkpoint.single_file import load_single_file, save_single_file
from hpctrain.cli.dispatch import main
from hpctrain.train import metrics
from hpctrain.train.metrics import MetricsLog
from hpctrain.train.trainer import Trainer
from tests.full_disk import fill, small_filesystem
from tests.helpers import cpu_world, hpctrain_cmd, run, tiny_config


@pytest.fixture
def full_disk():
    """A 1 MiB tmpfs, empty (the tests fill it as they need); skips where none mounts."""
    with small_filesystem("1m") as point:
        if point is None:
            pytest.skip(small_filesystem.why)
        yield point


@pytest.fixture(scope="module")
def checkpoint(dataset_path, tmp_path_factory):
    """A run's out_dir with a sharded checkpoint of step 10 (on the ordinary disk)."""
    out = tmp_path_factory.mktemp("ckpt")
    cfg = tiny_config(dataset_path, out, **{"train.save_checkpoint": True})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    trainer.fit()
    trainer.close()
    return out


def _records(path) -> list[dict]:
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"a torn last line: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def _one_line_write_error(message: str, output) -> None:
    assert "\n" not in message.strip(), message
    assert f"writing {output} failed" in message and "make room" in message, message


def _only(folder, *names) -> None:
    left = sorted(p.name for p in folder.iterdir())
    assert left == sorted(names), f"temporaries left behind: {left}"


# ------------------------------------------------------------------------ metrics.jsonl

def test_metrics_on_a_full_disk_stop_with_whole_lines_only(full_disk):
    log = MetricsLog(full_disk / "metrics.jsonl", enabled=True)
    log.write({"step": 0, "loss": 1.0})
    fill(full_disk, leave=0)
    with pytest.raises(OutputError) as e:
        for step in range(1, 10_000):  # a page may still take a few records
            log.write({"step": step, "note": "x" * 200})
    log.close()
    _one_line_write_error(str(e.value), full_disk / "metrics.jsonl")
    assert "--train.resume=auto" in str(e.value)
    records = _records(full_disk / "metrics.jsonl")
    assert records[0] == {"step": 0, "loss": 1.0}
    assert [r["step"] for r in records] == list(range(len(records)))


def test_a_run_whose_disk_fills_stops_with_one_message(dataset_path, full_disk):
    """The trainer's own writes: the disk fills after the run started (the lock and the
    log's file exist); the first record that does not fit stops the run with the
    message, and the log holds whole lines."""
    cfg = tiny_config(dataset_path, full_disk / "run")
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    fill(full_disk, leave=0)
    with pytest.raises(OutputError) as e:
        trainer.fit()
    trainer.close()
    _one_line_write_error(str(e.value), full_disk / "run" / "metrics.jsonl")
    _records(full_disk / "run" / "metrics.jsonl")


def test_a_short_write_of_a_metrics_line_is_taken_back(tmp_path, monkeypatch):
    """A file system that takes part of a line and says so (``write`` returns less)."""
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    log.write({"step": 0})
    real = os.write
    monkeypatch.setattr(metrics.os, "write",  # the log's file alone, not pytest's
                        lambda fd, data: real(fd, data[:7] if fd == log._fd else data))
    with pytest.raises(OutputError, match=r"7 of the \d+ bytes of a line were written"):
        log.write({"step": 1, "loss": 2.5})
    monkeypatch.undo()
    log.close()
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 0}]


def test_a_failed_metrics_write_is_taken_back(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    log.write({"step": 0})

    real = os.write

    def full(fd, data):
        if fd != log._fd:
            return real(fd, data)
        real(fd, data[:3])
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(metrics.os, "write", full)
    with pytest.raises(OutputError, match="Disk quota exceeded"):
        log.write({"step": 1})
    monkeypatch.undo()
    log.close()
    assert _records(tmp_path / "metrics.jsonl") == [{"step": 0}]


@pytest.mark.parametrize("tail", [b'{"step": 5, "lo', b"\0" * 9000, b'{"x"' * 30000])
def test_a_torn_last_line_is_cut_when_the_log_is_opened_to_append(tmp_path, tail):
    """The process killed in the middle of a line (or a crash leaving zeros): the next
    run's first record must start a line of its own."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 0}\n{"step": 5}\n' + tail)
    log = MetricsLog(path, enabled=True, resumed_at=5)
    assert len(log.notes) == 1 and f"({len(tail)} bytes" in log.notes[0]
    log.write({"step": 6})
    log.close()
    assert _records(path) == [{"step": 0}, {"step": 5}, {"step": 6}]


def test_a_whole_log_is_not_touched_on_append(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n')
    assert MetricsLog(path, enabled=True, resumed_at=1).notes == []
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"st')  # one partial line and nothing else: all of it goes
    assert MetricsLog(torn, enabled=True, resumed_at=1).notes
    assert torn.read_text() == ""


def test_a_resumed_run_repairs_a_torn_metrics_tail(dataset_path, tmp_path):
    cfg = tiny_config(dataset_path, tmp_path, **{"train.save_checkpoint": True,
                                                 "train.max_iters": 5})
    Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False).fit()
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 5, "loss": 3.')  # killed in the middle of a write
    cfg = tiny_config(dataset_path, tmp_path, **{"train.save_checkpoint": True,
                                                 "train.resume": "auto"})
    trainer = Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert any("cut a partial last line" in n for n in trainer.metrics.notes)
    trainer.fit()
    steps = [r["step"] for r in _records(tmp_path / "metrics.jsonl") if "step" in r]
    assert steps == sorted(steps) and steps[-1] == 10


def test_records_past_the_resumed_step_move_aside_and_each_step_keeps_one(tmp_path):
    """An attempt killed at step 8 after its checkpoint of step 5: the resumed run logs
    6-8 again, so the killed attempt's 6-8 go to previous-<time>/, not deleted."""
    path = tmp_path / "metrics.jsonl"
    old = [{"step": s, "loss": 9.0} for s in (2, 4, 6, 8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old) + "not json\n")
    log = MetricsLog(path, enabled=True, resumed_at=5)
    assert len(log.notes) == 1 and "2 record(s) past step 5" in log.notes[0]
    log.write({"step": 6, "loss": 1.0})
    log.close()
    assert path.read_text().splitlines()[:3] == [json.dumps(old[0]), json.dumps(old[1]),
                                                 "not json"]
    assert _records_of(path) == [2, 4, 6]
    (previous,) = tmp_path.glob("previous-*")
    assert [json.loads(x) for x in (previous / "metrics.jsonl").read_text().splitlines()] \
        == old[2:]
    assert MetricsLog(path, enabled=True, resumed_at=6).notes == []  # nothing past 6


def _records_of(path) -> list[int]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except ValueError:
            pass
    return out


# ---------------------------------------------------------------- final.h5 and ckpt tools

def test_final_h5_on_a_full_disk_keeps_the_earlier_file(full_disk):
    params = {"w": torch.ones(64, 64)}
    good = save_single_file(full_disk / "final.h5", params, None, step=1, config={},
                            tokenizer={})
    before = good.read_bytes()
    fill(full_disk, leave=0)
    with pytest.raises(OutputError) as e:
        save_single_file(good, {"w": torch.ones(512, 512)}, None, step=2, config={},
                         tokenizer={})
    _one_line_write_error(str(e.value), good)
    assert "No space left on device" in str(e.value)
    assert good.read_bytes() == before and load_single_file(good).step == 1
    _only(full_disk, "final.h5", "filler")


@pytest.mark.parametrize("command", [
    ["merge", "--output", "{out}/merged.h5"],
    ["export", "--format", "safetensors", "--output", "{out}/model.safetensors"],
    ["export", "--format", "hf", "--output", "{out}/hf"],
    ["export", "--format", "dcp", "--output", "{out}/dcp"],
    ["reshard", "--world", "2", "--zero", "1", "--output", "{out}/resharded"],
])
def test_ckpt_tools_on_a_full_disk_are_one_line_and_exit_2(checkpoint, full_disk, capsys,
                                                            command):
    fill(full_disk, leave=32 << 10)  # room for a little, not for the weights
    action, *options = command
    options = [o.format(out=full_disk) for o in options]
    status = main(["ckpt", action, str(checkpoint), *options])
    err = capsys.readouterr().err
    assert status == 2, err
    _one_line_write_error(err, options[-1])
    _only(full_disk, "filler")


@pytest.mark.slow  # starts processes
def test_a_full_disk_exits_2_from_the_command_line(checkpoint, full_disk):
    fill(full_disk, leave=32 << 10)
    p = run(hpctrain_cmd("ckpt", "reshard", str(checkpoint), "--world", "2", "--zero", "1",
                         "--output", str(full_disk / "resharded")))
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: writing ") and p.stderr.count("\n") == 1, p.stderr
    _only(full_disk, "filler")


@pytest.mark.parametrize("error", [RuntimeError("Can't write data (No space left on "
                                                "device)"),
                                   OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))],
                         ids=["h5py", "EDQUOT"])
def test_an_injected_write_failure_of_final_h5_is_one_error(tmp_path, monkeypatch, error):
    """The same without a tmpfs: h5py's failure to write (its own text) or a quota."""
    import h5py

    good = save_single_file(tmp_path / "final.h5", {"w": torch.ones(4)}, None, step=1,
                            config={}, tokenizer={})

    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(h5py.Group, "create_dataset", fail)
    with pytest.raises(OutputError) as e:
        save_single_file(good, {"w": torch.ones(4)}, None, step=2, config={}, tokenizer={})
    _one_line_write_error(str(e.value), good)
    assert load_single_file(good).step == 1
    _only(tmp_path, "final.h5")


def test_a_report_to_a_full_disk_is_one_line_exit_2_and_no_torn_page(full_disk, tmp_path,
                                                                     capsys):
    """The page is written whole or not at all: an earlier report.html stays as it was."""
    from hpctrain.cli import main as cli
    from tests.report_runs import finished_run

    run_dir = finished_run(tmp_path / "run")
    out = full_disk / "report"
    out.mkdir()
    (out / "report.html").write_text("the earlier page")
    fill(full_disk, leave=0)
    assert cli(["report", str(run_dir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "make room" in err and "No space left" in err, err
    assert (out / "report.html").read_text() == "the earlier page"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left

