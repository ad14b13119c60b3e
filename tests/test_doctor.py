"""``hpctrain doctor`` in one process: every section is reported, device rows say "no
accelerator" on the CPU and run through the fake device's paths with ``device=fake``, a
planted fault fails the run naming its check; ``jobscript --doctor`` writes a job that
runs it. (At 2 and 4 ranks: test_doctor_mpi.py.)"""

import json

import pytest
from mpi4py import MPI

from hpctrain.cli import main
from hpctrain.comm.world import World
from hpctrain.doctor.comm_checks import FAULT_ENV
from hpctrain.doctor.report import SECTIONS
from hpctrain.doctor.run import run_doctor
from hpctrain.errors import JobError
from hpctrain.jobs.command import check_command
from hpctrain.jobs.render import render
from hpctrain.jobs.spec import build_spec

SIZES = (0.25, 0.5)


def doctor(tmp_path, device="cpu", gpu_aware="auto"):
    world = World.create(MPI.COMM_WORLD, device=device, gpu_aware=gpu_aware, timeout=60)
    lines = []
    try:
        rc = run_doctor(world, sizes_mib=SIZES, model="small", json_path=tmp_path / "d.json",
                        out=lines.append)
    finally:
        world.close()
    return rc, "\n".join(lines), json.loads((tmp_path / "d.json").read_text())


def test_cpu_passes_with_every_section(tmp_path):
    rc, text, report = doctor(tmp_path)
    assert rc == 0, text
    assert report["ok"] and report["failures"] == []
    for section in SECTIONS:
        assert section in report, section
    rows = report["allreduce"]
    assert [(r["size_mib"], r["memory"]) for r in rows] == \
        [(s, m) for s in SIZES for m in ("host", "device")]
    assert all(r["status"] == "no accelerator" for r in rows if r["memory"] == "device")
    assert all(r["status"] == "ok" and r["algbw_GBps"] > 0 for r in rows
               if r["memory"] == "host")
    assert report["train"]["model"] == "small" and report["train"]["tokens_per_s"] > 0
    assert report["train"]["mfu"] is None  # no peak known for a CPU
    assert set(report["gpu_aware"]["per_vendor"]) == {"CUDA", "ROCm", "Level Zero"}
    assert report["ranks"][0]["cpus"] and report["mpi"]["thread_level"]
    assert "no accelerator" in text and "all checks passed" in text


@pytest.mark.parametrize("aware", ["no", "yes"])
def test_fake_device_rows_run(tmp_path, aware):
    rc, text, report = doctor(tmp_path, device="fake", gpu_aware=aware)
    assert rc == 0, text
    device = [r for r in report["allreduce"] if r["memory"] == "device"]
    assert device and all(r["status"] == "ok" for r in device)
    assert all(r["staged"] == (aware == "no") for r in device)
    assert "fake" in report["ranks"][0]["device"]


@pytest.mark.parametrize("check", ["allreduce", "train"])
def test_planted_fault_fails_naming_the_check(tmp_path, monkeypatch, check):
    monkeypatch.setenv(FAULT_ENV, check)
    rc, text, report = doctor(tmp_path)
    assert rc == 1
    assert not report["ok"] and report["failures"][0].startswith(f"{check}:")
    assert f"FAILED:\n  {check}:" in text


def test_cli_prints_the_report(tmp_path, capsys):
    assert main(["doctor", "--sizes", "0.25", "--model", "small", "--device", "cpu",
                 "--json", str(tmp_path / "r.json")]) == 0
    assert "hpctrain doctor: 1 rank(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["ok"]


def test_jobscript_doctor_runs_doctor_into_the_run_dir(tmp_path, capsys):
    out = tmp_path / "job.sh"
    assert main(["jobscript", "--system", "local", "--doctor", "--venv", "none",
                 "--output", str(out)]) == 0
    text = out.read_text()
    assert "-m hpctrain doctor" in text and '--json="${RUN_DIR}"/doctor.json' in text
    assert "train.out_dir" not in text and "(doctor.json)" in text
    assert "doctor.json" in capsys.readouterr().out
    assert main(["jobscript", "--system", "local", "--doctor", "--", "train",
                 "default"]) == 2  # one or the other
    spec = build_spec(system="local", command=["doctor", "--model", "small"], venv="none")
    assert "--model small" in render(spec).replace("\n    ", " ")


def test_job_doctor_options_are_checked():
    assert check_command(["doctor", "--sizes", "1", "--device=cpu"]) == \
        ("", ["--sizes", "1", "--device=cpu"])
    with pytest.raises(JobError, match="--json"):
        check_command(["doctor", "--json", "x.json"])
