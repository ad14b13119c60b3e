"""Run pytest on every rank under mpiexec; only rank 0 prints the report.

    mpiexec -n 4 python -m tests.mpi_pytest --only-mpi tests [--junitxml=FILE]

Ranks 1..n-1 send stdout to /dev/null before pytest starts capturing; their failures
still reach stderr through ``conftest.pytest_runtest_logreport``, which also aborts all
ranks so that a failure never becomes a hang. They also drop ``--junitxml``: every rank
runs the same tests, and n ranks writing one file would leave whichever finished last.

Each rank keeps its temporary directories under its own root (``PYTEST_DEBUG_TEMPROOT``):
pytest's end-of-session cleanup of ``pytest-of-<user>`` is not safe against other pytest
processes doing the same, and n ranks (plus any leg running beside them) finishing at once
removed each other's ``pytest-current`` link. A rank's root goes when the run passes and
stays, for reading, when it fails.
"""

import os
import shutil
import sys
import tempfile

import pytest

from hpctrain.comm.abort import env_rank


def without_junitxml(args: list[str]) -> list[str]:
    """``args`` less pytest's JUnit report option, in its ``=`` and two-word forms."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--junitxml", "--junit-xml"):
            skip = True  # the file name is the next word
        elif not a.startswith(("--junitxml=", "--junit-xml=")):
            out.append(a)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if env_rank() != 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        args = without_junitxml(args)
    os.environ["PYTEST_DEBUG_TEMPROOT"] = root = tempfile.mkdtemp(
        prefix=f"hpctrain-mpi-pytest-rank{env_rank()}-")
    code = pytest.main(args)
    if code == 0:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.COMM_WORLD.Barrier()  # rank 0's directory is every rank's shared_tmp
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(code)
