"""Run pytest on every rank under mpiexec; only rank 0 prints the report.

    mpiexec -n 4 python -m tests.mpi_pytest --only-mpi tests [--junitxml=FILE]

Ranks 1..n-1 send stdout to /dev/null before pytest starts capturing; their failures
still reach stderr through ``conftest.pytest_runtest_logreport``, which also aborts all
ranks so that a failure never becomes a hang. They also drop ``--junitxml``: every rank
runs the same tests, and n ranks writing one file would leave whichever finished last.
"""

import os
import sys

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
    sys.exit(pytest.main(args))
