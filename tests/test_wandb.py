"""``--train.wandb``: rank 0 logs the same grouped scalars as TensorBoard and the config
once; offline into ``<out_dir>/wandb/`` with the ``wandb sync`` command printed at the end;
a resumed run continues the same W&B run id. The unit tests stand a recording module in
for ``wandb``; the ``report`` leg (which installs the ``wandb`` extra) trains offline with
the real package and reads its ``.wandb`` files back."""

import json
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain.errors import ConfigError, UserError
from hpctrain.train.tensorboard import ScalarSinks, scalars_of
from hpctrain.train.trainer import Trainer
from hpctrain.train.wandb_log import RUN_ID_FILE, WandbLog, offline_folders, run_id
from tests.helpers import cpu_world, tiny_config


class FakeRun:
    def __init__(self, kwargs: dict):
        self.kwargs, self.logged, self.finished, self.torn_down = kwargs, [], False, False

    def log(self, data: dict, step: int):
        self.logged.append((step, dict(data)))

    def finish(self):
        self.finished = True


class FakeWandb:
    """Stands in for the ``wandb`` module: what each ``init`` got and its run logged; an
    offline ``init`` makes the folder wandb makes."""

    Settings = dict

    def __init__(self):
        self.runs: list[FakeRun] = []

    def teardown(self):
        self.runs[-1].torn_down = True

    def init(self, **kwargs) -> FakeRun:
        Path(kwargs["dir"], "wandb", f"offline-run-2026010{len(self.runs)}_000000-"
                                     f"{kwargs['id']}").mkdir(parents=True)
        self.runs.append(FakeRun(kwargs))
        return self.runs[-1]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train(cfg, capsys) -> list[str]:
    """Train; the lines the run printed."""
    capsys.readouterr()
    Trainer(cfg, cpu_world(MPI.COMM_SELF)).fit()
    return capsys.readouterr().out.splitlines()


def _sync_line(lines: list[str]) -> str:
    found = [line for line in lines if "wandb sync " in line]
    assert len(found) == 1, lines
    return found[0].split("wandb sync ", 1)[1]


def test_a_run_logs_its_records_and_config_and_a_resume_continues_its_w_and_b_run(
        dataset_path, tmp_path, monkeypatch, capsys):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    common = {"train.wandb": "offline", "train.save_checkpoint": True,
              "train.eval_interval": 5, "train.eval_iters": 1, "train.final_eval": True}
    cfg = tiny_config(dataset_path, out, **common)
    sync = _sync_line(_train(cfg, capsys))
    first = fake.runs[0]
    identifier = (out / "wandb" / RUN_ID_FILE).read_text().strip()
    assert first.kwargs == {"project": "hpctrain", "name": "run", "id": identifier,
                            "resume": "allow", "dir": str(out), "mode": "offline",
                            "config": cfg.to_dict(), "settings": {"console": "off"}}
    assert first.logged == [(r["step"], scalars_of(r)) for r in _records(out)]
    assert first.logged[0][1]["train/loss"] == _records(out)[0]["loss"]
    assert first.finished and first.torn_down  # the service stopped: the files are whole
    assert sync == str(out / "wandb" / f"offline-run-20260100_000000-{identifier}")

    resumed = tiny_config(dataset_path, out, **{**common, "train.max_iters": 15,
                                                "train.resume": "auto"})
    sync = _sync_line(_train(resumed, capsys))
    assert fake.runs[1].kwargs["id"] == identifier  # the same W&B run continues
    assert [step for step, _ in fake.runs[1].logged] == [15, 15]  # step 15, its final eval
    assert sync.split() == [str(out / "wandb" / f"offline-run-2026010{i}_000000-{identifier}")
                            for i in (0, 1)]

    fresh = tiny_config(dataset_path, out, **{**common, "train.overwrite": True})
    _train(fresh, capsys)
    assert fake.runs[2].kwargs["id"] != identifier  # the earlier wandb/ moved aside
    assert list(out.glob(f"previous-*/wandb/offline-run-*-{identifier}"))


def test_other_ranks_and_off_start_no_w_and_b_run(dataset_path, tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = tiny_config(dataset_path, tmp_path, **{"train.wandb": "offline"})
    log = ScalarSinks.check(cfg).open(is_root=False)
    log.write({"step": 5, "loss": 2.0})
    log.close()
    off = ScalarSinks.check(tiny_config(dataset_path, tmp_path)).open(is_root=True)
    off.write({"step": 5, "loss": 2.0})
    off.close()
    assert fake.runs == [] and not (tmp_path / "wandb").exists()  # off by default


def test_online_is_only_where_asked_and_prints_no_sync_command(dataset_path, tmp_path,
                                                               monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    printed = []
    cfg = tiny_config(dataset_path, tmp_path / "mine", **{
        "train.wandb": "online", "train.wandb_project": "p", "train.wandb_name": "n"})
    log = ScalarSinks.check(cfg).open(is_root=True, log=printed.append)
    log.write({"step": 5, "loss": 2.0, "val_loss": 2.5})
    log.close()
    run, = fake.runs
    assert (run.kwargs["mode"], run.kwargs["project"], run.kwargs["name"]) == (
        "online", "p", "n")
    assert run.logged == [(5, {"train/loss": 2.0, "val/loss": 2.5})] and printed == []


def test_without_the_package_training_is_refused_before_anything_is_written(
        dataset_path, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it fails
    cfg = tiny_config(dataset_path, tmp_path / "run", **{"train.wandb": "offline"})
    with pytest.raises(ConfigError, match=re.escape("pip install 'hpctrain[wandb]'")):
        Trainer(cfg, cpu_world(MPI.COMM_SELF), verbose=False)
    assert not (tmp_path / "run").exists()


WITHOUT_WANDB = """
import sys
sys.modules["wandb"] = None
from hpctrain.cli import main
sys.exit(main(["train", "default", "--train.wandb=offline", "--train.out_dir=" + sys.argv[1]]))
"""


@pytest.mark.slow
def test_without_the_package_the_command_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-c", WITHOUT_WANDB, str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    line, = done.stderr.strip().splitlines()
    assert line.startswith("error: --train.wandb=offline needs the wandb package (")
    assert line.endswith("): run `pip install 'hpctrain[wandb]'`, or pass --train.wandb=off")
    assert not (tmp_path / "run").exists()


def test_a_w_and_b_run_that_cannot_start_is_one_message_naming_the_way_out(
        dataset_path, tmp_path):
    class NoLogin(FakeWandb):
        def init(self, **kwargs):
            raise RuntimeError("api_key not configured (no-tty)")

    cfg = tiny_config(dataset_path, tmp_path, **{"train.wandb": "online"})
    with pytest.raises(UserError, match=re.escape(
            "W&B could not start the run (RuntimeError: api_key not configured (no-tty)); "
            "online, run `wandb login` first; or pass --train.wandb=offline (or off)")):
        WandbLog.start(NoLogin(), cfg)


def test_the_folders_of_the_offline_starts_go_oldest_first(tmp_path):
    """W&B adds -1, -2... to a folder whose start second another start of the run took."""
    names = ["offline-run-20260101_000002-abc", "offline-run-20260101_000001-abc-10",
             "offline-run-20260101_000001-abc", "offline-run-20260101_000001-abc-2",
             "offline-run-20260101_000001-abcd", "run-20260101_000001-abc", "latest-run"]
    for name in names:
        (tmp_path / name).mkdir()
    assert [p.name for p in offline_folders(tmp_path, "abc")] == [
        "offline-run-20260101_000001-abc", "offline-run-20260101_000001-abc-2",
        "offline-run-20260101_000001-abc-10", "offline-run-20260101_000002-abc"]
    assert offline_folders(tmp_path / "none", "abc") == []


def test_the_run_id_is_kept_and_a_damaged_one_is_named(tmp_path):
    ids = iter(["abc123", "other"])
    assert run_id(tmp_path / "wandb", lambda: next(ids)) == "abc123"
    assert run_id(tmp_path / "wandb", lambda: next(ids)) == "abc123"
    (tmp_path / "wandb" / RUN_ID_FILE).write_text("../../etc\n")
    with pytest.raises(UserError, match="not a W&B run id; remove it"):
        run_id(tmp_path / "wandb", lambda: next(ids))


# ---- the real package (the report leg installs the wandb extra) ----------------------

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_file(path: Path) -> list:
    """The records of an offline run's ``.wandb`` file, parsed by wandb's own protobuf
    class (``wandb.proto.wandb_internal_pb2.Record``). The package ships no Python reader
    of the file (wandb-core writes it), so its framing is read here: a 7-byte header
    (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log format (32 KiB blocks, each
    piece a CRC-32 of its type and data, a length and a type); every CRC is checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, pending, records = 7, b"", []
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece = data[pos + 7:pos + 7 + length]
        if kind == 0 and length == 0:
            break  # zeros: the end of what was written
        assert zlib.crc32(bytes([kind]) + piece) == crc, f"bad CRC at byte {pos}"
        pos += 7 + length
        pending += piece
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history(records) -> dict[str, list[tuple[int, float]]]:
    """Each logged tag's (step, value) from the history records, in order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            for item in r.history.item:
                name = item.key or "/".join(item.nested_key)
                if not name.startswith("_"):
                    out.setdefault(name, []).append((r.history.step.num,
                                                     json.loads(item.value_json)))
    return out


@pytest.mark.report
def test_wandbs_own_records_hold_the_losses_and_config_of_an_offline_run(
        dataset_path, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb", reason="needs the wandb extra (make test-report installs it)")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever the code asks
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    common = {"train.wandb": "offline", "train.save_checkpoint": True,
              "train.eval_interval": 5, "train.eval_iters": 1}
    _train(tiny_config(dataset_path, out, **common), capsys)
    lines = _train(tiny_config(dataset_path, out, **{**common, "train.max_iters": 15,
                                                     "train.resume": "auto"}), capsys)
    identifier = (out / "wandb" / RUN_ID_FILE).read_text().strip()
    folders = offline_folders(out / "wandb", identifier)
    assert len(folders) == 2  # one per start, one W&B run id
    assert _sync_line(lines).split() == [str(f) for f in folders]
    got: dict[str, list] = {}
    runs = []
    for folder in folders:
        records = read_wandb_file(folder / f"run-{identifier}.wandb")
        runs += [r.run for r in records if r.WhichOneof("record_type") == "run"]
        for name, points in _history(records).items():
            got.setdefault(name, []).extend(points)
    steps = [r for r in _records(out) if r.get("loss") is not None]
    assert got["train/loss"] == [(r["step"], r["loss"]) for r in steps]  # JSON, exact
    assert got["val/loss"] == [(r["step"], r["val_loss"]) for r in steps if "val_loss" in r]
    assert [s for s, _ in got["train/loss"]] == [5, 10, 15]
    assert {run.run_id for run in runs} == {identifier} and runs[0].project == "hpctrain"
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["train"]["wandb"] == "offline"
    assert config["model"]["n_embd"] == 32
