"""Find the tests that never run: read every leg's JUnit XML report, fail on a test that
is skipped in every leg it appears in.

    python -m tests.skip_audit [--expect unit,mpi2,mpi4,hf,slurm,report] [test-reports]

Each ``<leg>.xml`` in the folder is one leg of the suite: ``make test`` writes unit, mpi2
and mpi4, ``make test-hf`` writes hf, ``make test-slurm`` writes slurm (the tests under a
real one-node Slurm, tests/test_slurm_real.py), ``make test-report`` writes report
(TensorBoard and the run report's page in headless chromium). A skip in one leg is fine when another leg runs the
test (MPI tests skip in one process, one-process tests skip under mpiexec); a test that
only ever skips checks nothing, and a skip reason alone does not show it. The audit exits
1 for such a test unless tests/skip_allowlist.txt names it (tests that no machine of this
project can run, each with its reason), for a failed test, and for a missing leg.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ALLOWLIST = Path(__file__).with_name("skip_allowlist.txt")
STATUSES = ("passed", "failed", "skipped", "xfailed")
# When one test has several entries in a leg (a teardown error after a pass), the worst
# wins; an xfail ran the test's code, so it counts as run but not as passed.
_PRECEDENCE = {"skipped": 0, "xfailed": 1, "passed": 2, "failed": 3}


@dataclass(frozen=True)
class Outcome:
    status: str  # one of STATUSES
    reason: str = ""  # the skip reason or the failure message


def read_leg(path: str | Path) -> dict[str, Outcome]:
    """Test id (``module::name[params]``) -> outcome, from one pytest JUnit XML file."""
    results: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = _outcome(case)
        old = results.get(test_id)
        if old is None or _PRECEDENCE[outcome.status] > _PRECEDENCE[old.status]:
            results[test_id] = outcome
    return results


def _outcome(case: ET.Element) -> Outcome:
    for tag in ("failure", "error"):
        bad = case.find(tag)
        if bad is not None:
            return Outcome("failed", bad.get("message", ""))
    skipped = case.find("skipped")
    if skipped is None:
        return Outcome("passed")
    status = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
    return Outcome(status, skipped.get("message", ""))


def read_allowlist(path: str | Path) -> dict[str, str]:
    """Pattern -> reason. A line is a test id (fnmatch patterns allowed), whitespace, and
    why no machine of the project can run it; ``#`` starts a comment line."""
    allowed = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pattern, *reason = line.split(None, 1)
        if not reason:
            raise ValueError(f"{path}:{n}: {pattern} needs a reason after it")
        allowed[pattern] = reason[0].strip()
    return allowed


@dataclass
class Audit:
    counts: dict[str, Counter] = field(default_factory=dict)  # leg -> status -> n
    reasons: dict[str, Counter] = field(default_factory=dict)  # leg -> skip reason -> n
    never_run: dict[str, dict[str, str]] = field(default_factory=dict)  # id -> leg -> reason
    allowed: dict[str, str] = field(default_factory=dict)  # never-run id -> allow reason
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # leg, id, message
    missing: list[str] = field(default_factory=list)  # expected legs without a report
    unused: list[str] = field(default_factory=list)  # allow-list patterns that match none

    @property
    def unexplained(self) -> list[str]:
        return [t for t in self.never_run if t not in self.allowed]

    @property
    def ok(self) -> bool:
        return not (self.unexplained or self.failed or self.missing)


def audit(legs: dict[str, dict[str, Outcome]], allow: dict[str, str] | None = None,
          expect: tuple[str, ...] = ()) -> Audit:
    allow = allow or {}
    a = Audit(missing=[leg for leg in expect if leg not in legs])
    seen: dict[str, dict[str, Outcome]] = {}  # test id -> leg -> outcome
    for leg, results in legs.items():
        a.counts[leg] = Counter({s: 0 for s in STATUSES})
        a.counts[leg].update(o.status for o in results.values())
        a.reasons[leg] = Counter(o.reason for o in results.values() if o.status == "skipped")
        for test_id, o in results.items():
            seen.setdefault(test_id, {})[leg] = o
            if o.status == "failed":
                a.failed.append((leg, test_id, o.reason))
    for test_id in sorted(seen):
        if all(o.status == "skipped" for o in seen[test_id].values()):
            a.never_run[test_id] = {leg: o.reason for leg, o in seen[test_id].items()}
            for pattern, reason in allow.items():
                if fnmatch.fnmatchcase(test_id, pattern):
                    a.allowed[test_id] = reason
                    break
    a.unused = [p for p in allow if not any(fnmatch.fnmatchcase(t, p) for t in a.never_run)]
    return a


def render(a: Audit) -> str:
    width = max([len(leg) for leg in a.counts] + [3])
    lines = [f"{'leg':<{width}}  " + "  ".join(f"{s:>7}" for s in STATUSES)]
    for leg, c in a.counts.items():
        lines.append(f"{leg:<{width}}  " + "  ".join(f"{c[s]:>7}" for s in STATUSES))
    for leg, reasons in a.reasons.items():
        if reasons:
            lines.append(f"\n{leg}: skip reasons")
            lines += [f"  {n:>5}  {reason}" for reason, n in reasons.most_common()]
    if a.never_run:
        lines.append("\nnever run in any leg:")
        for test_id, by_leg in a.never_run.items():
            tag = f"  (allowed: {a.allowed[test_id]})" if test_id in a.allowed else ""
            lines.append(f"  {test_id}{tag}")
            lines += [f"      {leg}: {reason}" for leg, reason in by_leg.items()]
    lines += [f"\nFAILED in {leg}: {test_id}: {msg[:200]}" for leg, test_id, msg in a.failed]
    lines += [f"\nno report for the {leg} leg ({leg}.xml)" for leg in a.missing]
    lines += [f"\nallow-list entry {p!r} matches no never-run test: remove it" for p in a.unused]
    n = len(a.unexplained)
    verdict = (f"{n} test(s) never run and are not on the allow-list" if n else
               "every test runs in some leg" + (f" ({len(a.allowed)} allowed)" if a.allowed
                                                 else ""))
    lines.append(f"\nskip audit: {'OK' if a.ok else 'FAILED'}: {verdict}"
                 + (f"; {len(a.failed)} failed" if a.failed else "")
                 + (f"; missing legs: {', '.join(a.missing)}" if a.missing else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="?", default="test-reports",
                   help="folder of <leg>.xml JUnit reports")
    p.add_argument("--expect", default="", help="comma-separated legs that must have a report")
    p.add_argument("--allow", default=str(ALLOWLIST), help="allow-list file")
    args = p.parse_args(argv)
    files = sorted(Path(args.reports).glob("*.xml"))
    if not files:
        print(f"skip audit: no JUnit reports in {args.reports}/ (run make test test-hf test-slurm)",
              file=sys.stderr)
        return 1
    expect = tuple(leg for leg in args.expect.split(",") if leg)
    order = {leg: i for i, leg in enumerate(expect)}  # the expected legs in the order given
    files.sort(key=lambda f: (order.get(f.stem, len(order)), f.stem))
    legs = {f.stem: read_leg(f) for f in files}
    allow = read_allowlist(args.allow) if Path(args.allow).is_file() else {}
    result = audit(legs, allow, expect)
    print(render(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
