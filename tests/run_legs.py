"""Run the test suite's legs: some side by side, then the next group; every leg runs even
when an earlier one failed, and the last lines say which failed and how long each took.

    python -m tests.run_legs mpi2 unit+mpi4            # make test
    python -m tests.run_legs slow                       # make test-slow
    python -m tests.run_legs --select='-m "not slow and not report"' unit+mpi2  # test-fast

Each argument is a group of legs joined by ``+`` that run at once; groups run one after
another. ``make test`` runs the 2-rank leg first, alone, so that the single-process
references it computes are there for the 4-rank leg; the single-process leg runs beside
the 4-rank leg, whose waiting ranks sleep (more ranks than cores) and leave idle time
that the 2-rank leg's yielding ranks do not (tests/README.md has the times).
A leg's output goes to ``test-reports/<leg>.log`` and is printed when it ends, its
JUnit report to ``test-reports/<leg>.xml`` (``make test-audit`` reads them). The
single-process reference runs are kept in one temporary directory that every leg shares
(``HPCTRAIN_REF_CACHE``, tests/reference.py).

Legs:
- ``unit``: the single-process tests that are not ``slow`` (nor ``report``: those need
  the report extra and chromium, ``make test-report`` runs them);
- ``slow``: the single-process ``slow`` tests (long end-to-end runs: trainings under
  mpiexec, signals, job scripts, scaling studies);
- ``mpi2``, ``mpi4``: the ``mpi`` tests of ``tests/*_mpi.py`` at 2 and 4 ranks, through
  ``hpctrain.comm.local_mpiexec`` (``MPIEXEC`` names the launcher), but the few ``slow``
  ones (``make test-openmpi`` runs those at 2 and 4 ranks). The 4-rank leg presents the
  fake device as the node's accelerator (``HPCTRAIN_AUTO_DEVICE=fake``): the suite passes
  on a GPU node only if no comparison depends on what ``auto`` finds.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "test-reports"


def leg_command(name: str, select: list[str]) -> tuple[list[str], dict]:
    py = sys.executable
    junit = f"--junitxml={REPORTS / name}.xml"
    if name in ("unit", "slow"):
        # The `report` tests need the report extra and chromium: make test-report.
        marker = ["-m", "slow and not report" if name == "slow" else "not slow and not report"]
        return [py, "-m", "pytest", "-q", "tests", *marker, *select, junit], {}
    ranks = int(name.removeprefix("mpi"))
    mpi_tests = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("*_mpi.py"))
    # The few `slow` MPI tests (torch.compile under ZeRO: a cold compile costs half a
    # minute per rank) run in make test-openmpi, at 2 and 4 ranks.
    marker = ["-m", "not slow"]
    cmd = [py, "-m", "hpctrain.comm.local_mpiexec", "-n", str(ranks), py, "-m",
           "tests.mpi_pytest", "-q", "--only-mpi", *mpi_tests, *marker, *select, junit]
    return cmd, ({"HPCTRAIN_AUTO_DEVICE": "fake"} if ranks == 4 else {})


def run_group(names: list[str], select: list[str], limit: float) -> dict[str, tuple]:
    """Start every leg of the group, wait for all; {leg: (exit status, seconds)}."""
    started = {}
    for name in names:
        cmd, env = leg_command(name, select)
        log = open(REPORTS / f"{name}.log", "w")
        proc = subprocess.Popen(["timeout", str(int(limit)), *cmd], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})
        started[name] = (proc, log, time.monotonic())
    results = {}
    for name, (proc, log, t0) in started.items():
        rc = proc.wait()
        log.close()
        results[name] = (rc, time.monotonic() - t0)
        print(f"---- {name} leg (exit {rc}, {results[name][1]:.0f} s)", flush=True)
        sys.stdout.write((REPORTS / f"{name}.log").read_text())
        sys.stdout.flush()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("groups", nargs="+", help="legs joined by + run at once; groups in order")
    p.add_argument("--select", default="", help="pytest options for every leg (quoted)")
    p.add_argument("--time-limit", type=float,
                   default=float(os.environ.get("TIME_LIMIT", "1200")),
                   help="seconds each leg may take (default $TIME_LIMIT or 1200)")
    args = p.parse_args()
    REPORTS.mkdir(exist_ok=True)
    select = shlex.split(args.select)
    start = time.monotonic()
    results: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory(prefix="hpctrain-ref-") as ref:
        os.environ.setdefault("HPCTRAIN_REF_CACHE", ref)
        for group in args.groups:
            results.update(run_group(group.split("+"), select, args.time_limit))
    total = time.monotonic() - start
    summary = ", ".join(f"{n} {s:.0f} s{'' if rc == 0 else f' (FAILED, exit {rc})'}"
                        for n, (rc, s) in results.items())
    failed = [n for n, (rc, _) in results.items() if rc != 0]
    if failed:
        print(f"FAILED legs: {', '.join(failed)}; {summary}; {total:.0f} s in all", flush=True)
        return 1
    print(f"all legs passed in {total:.0f} s ({summary})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
