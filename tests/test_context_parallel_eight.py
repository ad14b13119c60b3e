"""The 8-rank context-parallel layouts (cp x tp x dp, cp x pp x dp) of
``tests/test_context_parallel_mpi.py``, launched under ``mpiexec -n 8`` from one process
(``make test-slow``; the MPI legs of ``make test`` run 2 and 4 ranks)."""

import re
import sys

import pytest

from tests.helpers import mpiexec, run

pytestmark = pytest.mark.slow


def test_context_parallel_at_eight_ranks():
    cmd = mpiexec(8, sys.executable, "-m", "tests.mpi_pytest", "-q", "--only-mpi",
                  "tests/test_context_parallel_mpi.py", "-k", "eight_rank")
    p = run(cmd, timeout=900, env={"HPCTRAIN_AUTO_DEVICE": "fake"})
    assert p.returncode == 0 and re.search(r"\b2 passed", p.stdout), \
        p.stdout[-4000:] + p.stderr[-2000:]
