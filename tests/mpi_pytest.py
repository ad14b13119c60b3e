"""Run pytest on every rank under mpiexec; only rank 0 prints the report.

    mpiexec -n 4 python -m tests.mpi_pytest --only-mpi tests

Ranks 1..n-1 send stdout to /dev/null before pytest starts capturing; their failures
still reach stderr through ``conftest.pytest_runtest_logreport``, which also aborts all
ranks so that a failure never becomes a hang.
"""

import os
import sys

import pytest

from hpctrain.comm.abort import env_rank

if __name__ == "__main__":
    if env_rank() != 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    sys.exit(pytest.main(sys.argv[1:]))
