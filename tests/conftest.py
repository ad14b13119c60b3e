"""Shared fixtures. Under ``mpiexec ... pytest --only-mpi`` a failing test on any rank
aborts every rank: a failure must never turn into a hang.

The suite's results never depend on the node: ``--train.device=auto`` takes the CPU here
(``HPCTRAIN_AUTO_DEVICE``, inherited by every rank and subprocess the tests start), even
where a GPU is visible, unless the leg names another kind. Tests that compare against
the single-process CPU reference also build their worlds with ``device="cpu"`` (the
comparison helpers refuse a world built with ``auto``); the 4-rank leg of ``make test``
runs with ``HPCTRAIN_AUTO_DEVICE=fake``, the fake accelerator standing in for a node's
GPU, which proves that no comparison depends on what ``auto`` finds.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import make_dataset

os.environ.setdefault("HPCTRAIN_AUTO_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    """The MPI legs of ``make test`` collect only ``tests/*_mpi.py``: an ``mpi`` test in
    any other file would run in no leg, so it is an error here."""
    stray = [item.nodeid for item in items
             if item.get_closest_marker("mpi") and not item.path.name.endswith("_mpi.py")]
    if stray:
        raise pytest.UsageError("tests marked `mpi` belong in tests/*_mpi.py (the MPI legs "
                                f"collect only those files): {', '.join(stray)}")


def pytest_runtest_logreport(report):
    if not report.failed:
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.COMM_WORLD.size == 1:
        return
    comm = mpi.COMM_WORLD
    print(f"\n[rank {comm.rank}/{comm.size}] FAILED {report.nodeid} ({report.when})\n"
          f"{report.longreprtext}", file=sys.stderr, flush=True)
    comm.Abort(1)


@pytest.fixture(scope="session")
def dataset_path(tmp_path_factory):
    """A small real token file (char tokenizer) prepared from standard-library sources."""
    return make_dataset(tmp_path_factory.mktemp("data") / "tiny.h5")


@pytest.fixture(scope="session")
def mpi_dataset(tmp_path_factory):
    """A small token file every rank reads: rank 0 makes it and broadcasts the path."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = None
    if comm.rank == 0:
        path = str(make_dataset(tmp_path_factory.mktemp("mpidata") / "tiny.h5"))
    return comm.bcast(path, root=0)


@pytest.fixture
def shared_tmp(tmp_path):
    """A directory every rank sees: rank 0 picks it and broadcasts the name."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.bcast(str(tmp_path) if MPI.COMM_WORLD.rank == 0 else None, root=0)
