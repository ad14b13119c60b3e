"""``hpctrain doctor`` over real ranks (2 and 4): it passes on the CPU and on the fake
device (device rows, the bf16 round trip between rank pairs through device memory), every
rank gets the same exit status, and a planted fault in the allreduce or the round trip
fails every rank, named in rank 0's result."""

import json

import pytest
from mpi4py import MPI

from hpctrain.comm.world import World
from hpctrain.doctor.comm_checks import FAULT_ENV
from hpctrain.doctor.run import run_doctor
from tests.helpers import two_ranks_suffice

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def doctor(tmp_path, device="cpu"):
    path = COMM.bcast(str(tmp_path / "doctor.json"), root=0)  # rank 0's file
    world = World.create(COMM, device=device, timeout=60)
    lines = []
    try:
        rc = run_doctor(world, sizes_mib=(0.25, 1), model="small", json_path=path,
                        out=lines.append)
    finally:
        world.close()
    result = json.loads(open(path).read()) if COMM.rank == 0 else None
    return rc, "\n".join(lines), result


@pytest.mark.parametrize("device", ["cpu", "fake"])
def test_doctor_passes(tmp_path, device):
    rc, text, result = doctor(tmp_path, device)
    assert COMM.allgather(rc) == [0] * COMM.size
    if COMM.rank == 0:
        assert result["ok"], text
        assert len(result["ranks"]) == COMM.size
        assert result["p2p"]["status"] == "ok"
        assert result["p2p"]["pairs"] == [[r, r + 1] for r in range(0, COMM.size - 1, 2)]
        assert result["p2p"]["memory"] == ("device" if device == "fake" else "host")
        device_rows = [r for r in result["allreduce"] if r["memory"] == "device"]
        assert {r["status"] for r in device_rows} == \
            {"ok" if device == "fake" else "no accelerator"}
        if device == "fake":  # MPI and the device library (gloo stands in for NCCL)
            assert {r["transport"] for r in device_rows} == {"mpi", "gloo"}
        assert result["train"]["status"] == "ok"


@two_ranks_suffice("a fault on one rank failing the other shows with two")
@pytest.mark.parametrize("check", ["allreduce", "p2p"])
def test_planted_fault_fails_every_rank(tmp_path, monkeypatch, check):
    monkeypatch.setenv(FAULT_ENV, check)
    rc, text, result = doctor(tmp_path, "fake")
    assert COMM.allgather(rc) == [1] * COMM.size
    if COMM.rank == 0:
        assert {f.split(":")[0] for f in result["failures"]} == {check}
        assert f"  {check}:" in text
