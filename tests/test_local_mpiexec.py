"""The launcher helper (hpctrain/comm/local_mpiexec.py) in one process: what each MPI
family's ``--version`` looks like and what each gets added. The real launches are every
test that starts ranks, under MPICH (``make test``) and Open MPI (``make test-openmpi``)."""

from __future__ import annotations

import os
import sys

import pytest

from hpctrain.comm.local_mpiexec import (MPICH_YIELD, ROOT_PERMISSION, Launcher, family_of,
                                         find_launcher, main)

# What `LAUNCHER --version` prints (first lines), as the launchers print it.
VERSIONS = {
    "hydra": "HYDRA build details:\n    Version:                                 4.2.0\n",
    "openmpi": "mpirun.openmpi (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/"
               "community/help/\n",
    "openmpi5": "mpirun (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/"
                "community/help/\n",
    "intel": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n",
    "slurm": "slurm 23.11.4\n",
}


@pytest.mark.parametrize("key,family", [("hydra", "hydra"), ("openmpi", "openmpi"),
                                        ("openmpi5", "openmpi"), ("intel", "intel"),
                                        ("slurm", "slurm")])
def test_the_family_is_read_from_the_version_text(key, family):
    assert family_of(VERSIONS[key]) == family


def test_pals_and_srun_are_known_by_name_too():
    assert family_of("", "/opt/cray/pals/1.4/bin/mpiexec") == "pals"
    assert family_of("mpiexec version 1.4.0 (PALS)") == "pals"
    assert family_of("", "/usr/bin/srun") == "slurm"
    assert family_of("something else", "/usr/bin/mpiexec") == "unknown"


def test_each_family_gets_only_its_own_flags():
    cmd = ("python", "-m", "hpctrain")
    assert Launcher(("mpiexec",), "hydra").command(2, *cmd) == \
        ["mpiexec", "-launcher", "fork", "-n", "2", *cmd]
    assert Launcher(("mpirun", "--bind-to", "none"), "openmpi").command(4, *cmd) == \
        ["mpirun", "--bind-to", "none", "--oversubscribe", "-n", "4", *cmd]
    for family in ("intel", "pals", "slurm", "unknown"):
        assert Launcher(("x",), family).command(2, *cmd) == ["x", "-n", "2", *cmd]


def test_root_permission_only_for_open_mpi_run_as_root(monkeypatch):
    monkeypatch.delenv(MPICH_YIELD, raising=False)
    assert Launcher(("mpirun",), "openmpi", root=True).env() == ROOT_PERMISSION
    assert Launcher(("mpirun",), "openmpi", root=False).env() == {}
    assert Launcher(("mpiexec",), "hydra", root=True).env() == {MPICH_YIELD: "1"}


def test_mpich_ranks_sleep_while_they_wait_unless_told_otherwise(monkeypatch):
    monkeypatch.setenv(MPICH_YIELD, "0")
    assert Launcher(("mpiexec",), "hydra").env() == {}
    assert Launcher(("mpiexec",), "hydra").environ()[MPICH_YIELD] == "0"
    env = Launcher(("mpirun",), "openmpi", root=True).environ({"A": "1"}, B="2")
    assert env == {"A": "1", **ROOT_PERMISSION, "B": "2"}


def test_MPIEXEC_wins_and_may_carry_flags(tmp_path):
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\necho 'mpirun (Open MPI) 5.0.3'\n")
    fake.chmod(0o755)
    got = find_launcher(env={"MPIEXEC": f"{fake} --bind-to none"})
    assert got.argv == (str(fake), "--bind-to", "none") and got.family == "openmpi"
    assert got.version == "mpirun (Open MPI) 5.0.3"
    assert got.root == (os.geteuid() == 0)


def test_without_MPIEXEC_the_mpiexec_beside_python_then_PATH(tmp_path):
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "mpiexec").write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    (bindir / "mpiexec").chmod(0o755)
    got = find_launcher(env={}, python=str(bindir / "python"))
    assert got.argv == (str(bindir / "mpiexec"),) and got.family == "hydra"
    bare = find_launcher(env={"PATH": ""}, python=str(tmp_path / "python"))
    assert bare.argv[0].endswith("mpiexec")


def test_a_launcher_that_does_not_answer_is_unknown_and_gets_nothing(tmp_path):
    got = find_launcher(env={"MPIEXEC": str(tmp_path / "missing")})
    assert got.family == "unknown" and got.command(2, "x")[1:] == ["-n", "2", "x"]


def test_the_command_line_entry_point(capsys, monkeypatch, tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MPIEXEC", str(fake))
    assert main(["--print", "-n", "3", "--", sys.executable, "-c", "pass"]) == 0
    assert capsys.readouterr().out.split() == [str(fake), "-launcher", "fork", "-n", "3",
                                               sys.executable, "-c", "pass"]
    assert main(["--describe"]) == 0
    assert capsys.readouterr().out.strip() == f"{fake} (hydra: HYDRA build details:)"
    assert main(["-n", "x", "cmd"]) == 2
