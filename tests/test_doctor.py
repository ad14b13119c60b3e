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
from hpctrain.doctor.node_check import SECTIONS
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
    rc, text, result = doctor(tmp_path)
    assert rc == 0, text
    assert result["ok"] and result["failures"] == []
    for section in SECTIONS:
        assert section in result, section
    rows = result["allreduce"]
    assert [(r["size_mib"], r["transport"]) for r in rows if r["memory"] == "host"] == \
        [(s, "mpi") for s in SIZES]
    assert [r["status"] for r in rows if r["memory"] == "device"] == ["no accelerator"]
    assert all(r["status"] == "ok" and r["algbw_GBps"] > 0 for r in rows
               if r["memory"] == "host")
    assert result["setup"] == {"system": None, "problems": []}
    assert result["train"]["model"] == "small" and result["train"]["tokens_per_s"] > 0
    assert result["train"]["mfu"] is None  # no peak known for a CPU
    assert set(result["gpu_aware"]["per_vendor"]) == {"CUDA", "ROCm", "Level Zero"}
    assert result["ranks"][0]["cpus"] and result["mpi"]["thread_level"]
    assert "no accelerator" in text and "all checks passed" in text


@pytest.mark.parametrize("aware", ["no", "yes"])
def test_fake_device_rows_run(tmp_path, aware):
    rc, text, result = doctor(tmp_path, device="fake", gpu_aware=aware)
    assert rc == 0, text
    device = [r for r in result["allreduce"] if r["memory"] == "device"]
    assert [r["transport"] for r in device] == ["mpi"] * len(SIZES)  # one rank: no library
    assert all(r["status"] == "ok" for r in device)
    assert all(r["staged"] == (aware == "no") for r in device)
    assert "fake" in result["ranks"][0]["device"]


@pytest.mark.parametrize("check", ["allreduce", "train"])
def test_planted_fault_fails_naming_the_check(tmp_path, monkeypatch, check):
    monkeypatch.setenv(FAULT_ENV, check)
    rc, text, result = doctor(tmp_path)
    assert rc == 1
    assert not result["ok"] and result["failures"][0].startswith(f"{check}:")
    assert f"FAILED:\n  {check}:" in text


def test_cli_prints_the_result(tmp_path, capsys):
    assert main(["doctor", "--sizes", "0.25", "--model", "small", "--device", "cpu",
                 "--json", str(tmp_path / "r.json")]) == 0
    assert "hpctrain doctor: 1 rank(s)" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["ok"]


def test_jobscript_doctor_runs_doctor_into_the_run_dir(tmp_path, capsys):
    out = tmp_path / "job.sh"
    assert main(["jobscript", "--system", "local", "--doctor", "--venv", "none",
                 "--output", str(out)]) == 0
    text = out.read_text()
    # The result goes with the attempt's records (jobs/<job id>/ in the run directory).
    assert "-m hpctrain doctor" in text and '--json="${ATTEMPT_DIR}"/doctor.json' in text
    assert "train.out_dir" not in text and "(doctor.json in jobs/<job id>/)" in text
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


# ------------------------------------------------------------- set-up and thresholds

def _row(rank, **kw):
    return {"rank": rank, "host": "n0", "device": f"cuda:{rank}", "device_id": f"GPU-{rank}",
            "cpus": "0-7", "gpu_cpus": "", "gpu_files": ["/dev/nvidia0"],
            "torch_gpu": "CUDA 12.8", **kw}


def _system(name="polaris"):
    from hpctrain.systems.registry import load_system

    return load_system(name)


PYPI_MPICH = "MPICH Version: 5.0.2\nMPICH Custom Information: https://pypi.org/p/mpich/5.0.2/"


def test_a_well_set_node_has_no_setup_problem():
    from hpctrain.doctor.setup_checks import setup_failures

    rows = [_row(0, gpu_cpus="0-15"), _row(1, cpus="8-15", gpu_cpus="0-15")]
    assert setup_failures(rows, library_version="HPE Cray MPICH 8.1.28", aware=True,
                          system=_system()) == []


@pytest.mark.parametrize("planted,check", [
    (dict(rows=[_row(0), _row(1, device_id="GPU-0")]), "devices"),
    (dict(rows=[_row(0, cpus="24-31", gpu_cpus="0-7")]), "numa"),
    (dict(aware=False), "gpu_aware"),
    (dict(library_version=PYPI_MPICH), "mpi"),
    (dict(rows=[_row(0, torch_gpu=None)]), "torch"),
])
def test_each_setup_mistake_is_named(planted, check):
    from hpctrain.doctor.setup_checks import setup_failures

    facts = dict(rows=[_row(0)], library_version="HPE Cray MPICH 8.1.28", aware=True,
                 system=_system())
    failures = setup_failures(**{**facts, **planted})
    assert [c for c, _ in failures] == [check]
    assert "\n" not in failures[0][1]


def test_setup_expectations_come_from_the_system():
    from hpctrain.doctor.setup_checks import setup_failures

    # The same facts on a machine with no known system, or one without a site MPI: no problem.
    for system in (None, _system("local")):
        assert setup_failures([_row(0)], library_version=PYPI_MPICH, aware=False,
                              system=system) == []
    for name in ("polaris", "perlmutter", "frontier", "aurora"):
        launch = _system(name).launch
        assert launch.vendor_mpi and launch.expects_gpu_aware_mpi, name


def _node_check(**sections):
    from hpctrain.doctor.node_check import NodeCheck

    result = NodeCheck()
    result.sections.update(sections)
    return result


def _allreduce(transport, staged, busbw):
    return [{"size_mib": s, "memory": "device", "transport": transport, "staged": staged,
             "status": "ok", "busbw_GBps": busbw if s == 150 else 0.1} for s in (1, 150)]


@pytest.mark.parametrize("rows,ok", [
    (_allreduce("nccl", False, 120.0), True),
    (_allreduce("nccl", False, 12.0), False),  # NCCL over PCIe or sockets
    (_allreduce("mpi", True, 3.0), True),
    (_allreduce("mpi", True, 0.5), False),
    (_allreduce("mpi", False, 4.0), False),  # GPU-aware MPI far below its floor
])
def test_bandwidth_floors_per_transport(rows, ok):
    from hpctrain.doctor.thresholds import judge

    result = _node_check(allreduce=rows)
    judge(result, accelerator=True, ranks=4)
    assert (result.failures == []) == ok
    judge(result := _node_check(allreduce=rows), accelerator=True, ranks=1)
    assert result.failures == []  # one rank moves nothing: no floor


def test_mfu_floor_applies_on_accelerators_only():
    from hpctrain.doctor.thresholds import MIN_MFU, judge

    slow = {"model": "gpt2-124m", "mfu": MIN_MFU / 2}
    result = _node_check(train=slow)
    judge(result, accelerator=True, ranks=1)
    assert result.failures and result.failures[0].startswith("train:")
    result = _node_check(train=slow)
    judge(result, accelerator=False, ranks=1)
    assert result.failures == []
    result = _node_check(train={**slow, "model": "small"})  # too small to load a GPU
    judge(result, accelerator=True, ranks=1)
    assert result.failures == []
