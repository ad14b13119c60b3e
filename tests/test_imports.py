"""Importing any module of hpctrain starts no MPI (ARCHITECTURE.md: login-node tools,
``--help`` and ``ckpt`` commands must run where ``MPI_Init`` cannot)."""

import json
import subprocess
import sys

# Run in a fresh interpreter: this test process may already have MPI running.
IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import hpctrain
names, skipped = [], {}
for info in pkgutil.walk_packages(hpctrain.__path__, "hpctrain."):
    if info.name.endswith("__main__"):
        continue  # runs the command line
    try:
        importlib.import_module(info.name)
        names.append(info.name)
    except ImportError as exc:  # an optional extra (transformers, tensorboard) not installed
        if (exc.name or "").startswith("hpctrain"):
            raise
        skipped[info.name] = str(exc)
mpi = sys.modules.get("mpi4py.MPI")
print(json.dumps({"names": names, "skipped": skipped,
                  "mpi_imported": mpi is not None,
                  "initialized": bool(mpi is not None and mpi.Is_initialized())}))
"""


def test_importing_every_module_starts_no_mpi():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "hpctrain.comm.world" in report["names"]
    assert "hpctrain.parallel.zero.engine" in report["names"]
    assert len(report["names"]) > 100, report
    assert not report["initialized"], "importing hpctrain's modules initialized MPI"
    assert not report["mpi_imported"], "a module imports mpi4py.MPI at import time"


def test_the_lazy_module_starts_mpi_at_first_use():
    probe = ("import sys; from hpctrain.comm.mpi import MPI\n"
             "before = 'mpi4py.MPI' in sys.modules\n"
             "size = MPI.COMM_WORLD.Get_size()\n"
             "print(before, MPI.Is_initialized(), size)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "1"]


CONFIG_ERROR = r"""
import sys
from hpctrain.cli import main
code = main(["train", "default", "--train.max_iter=20"])
print("mpi4py.MPI" in sys.modules, code)
"""


def test_a_config_error_of_train_exits_2_before_mpi_starts():
    """The train command reads and checks its configuration before MPI starts: under any
    launcher a typo is one line and exit 2 on every rank, never an MPI_Abort (srun
    recorded 9:0) nor a shared-memory segment left in /dev/shm."""
    done = subprocess.run([sys.executable, "-c", CONFIG_ERROR], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "2"], done.stdout
    assert done.stderr.strip().splitlines() == [
        "error: unknown option --train.max_iter; did you mean --train.max_iters?"]
