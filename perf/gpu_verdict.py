"""``perf/gpu_check.py``'s bookkeeping: each step under its own time limit inside the
whole check's budget, every step recorded whatever happens to it, and the verdict table
printed last (step, status, key number, goal, met).

A step's section is a dict with ``status``: ``ok``; ``FAILED`` (it broke: a finding);
``not possible`` (this node cannot do it: one GPU for a multi-GPU run, no FP8 units);
``skipped`` (the budget ran out before it). A step may also set ``key`` (its number in a
few words), ``goal`` and ``met`` (True, False, or None where no number was measured);
``earlier``: kept from an earlier result file by a rerun of other steps (``--only``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from perf.common import table_lines

OK, FAILED, NOT_POSSIBLE, SKIPPED = "ok", "FAILED", "not possible", "skipped"
MIN_START_S = 20.0
"""A step is not started with less of the budget left than this (it could not even
launch a run)."""


class Check:
    """The report, one section per step, and the budget they share."""

    def __init__(self, budget_s: float, limits: dict[str, float]):
        self.budget_s, self.limits = budget_s, limits
        self.start = time.monotonic()
        self.sections: dict[str, dict] = {}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def step(self, name: str, fn, ctx) -> None:
        """Run ``fn(ctx)`` with ``ctx.deadline`` at the step's limit or the budget's end,
        whichever comes first; record its section (an exception is a FAILED section)."""
        limit = min(self.limits[name], self.left())
        print(f"== {name} (limit {limit:.0f} s)", flush=True)
        t0 = time.monotonic()
        if limit < MIN_START_S:
            section = {"status": SKIPPED, "why": f"out of budget: {max(0, self.left()):.0f} "
                       f"s left of {self.budget_s:.0f}"}
        else:
            ctx.deadline, ctx.sections = t0 + limit, self.sections
            try:
                section = fn(ctx)
            except Exception as e:  # a broken step is a finding: record it, go on
                section = {"status": FAILED, "error": f"{type(e).__name__}: {e}"[-2000:]}
        section.setdefault("status", OK)
        section["seconds"] = round(time.monotonic() - t0, 1)
        section["limit_s"] = round(limit)
        self.sections[name] = section
        print(json.dumps(section, indent=1, default=str)[:3000], flush=True)

    @property
    def failed(self) -> list[str]:
        return failed_steps(self.sections)


def failed_steps(sections: dict) -> list[str]:
    """Steps to run again: those that broke or did not run."""
    return [n for n, s in sections.items() if s["status"] in (FAILED, SKIPPED)]


def earlier_sections(path: Path) -> dict:
    """The sections of an earlier check's result at ``path`` ({} when there is none): a
    rerun of some steps (``--only``) keeps the others' results."""
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text()).get("sections", {})
    except (OSError, ValueError):
        return {}


def parse_only(text: str | None, steps: list[str]) -> list[str]:
    """``--only a,b``'s steps, checked against ``steps`` (all of them when not given)."""
    if not text:
        return list(steps)
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in steps]
    if unknown:
        raise SystemExit(f"--only: unknown step(s) {', '.join(unknown)}; the steps are "
                         f"{', '.join(steps)}")
    return chosen


def met_word(met) -> str:
    return "-" if met is None else ("yes" if met else "NO")


def key_words(section: dict, width: int = 60) -> str:
    """A section's key number, else why it did not run or what broke (first line)."""
    text = section.get("key") or section.get("why") or section.get("error") or ""
    text = str(text).strip().splitlines()[0] if str(text).strip() else ""
    return text if len(text) <= width else text[:width - 3] + "..."


VERDICT_COLUMNS = ["step", "status", "key number", "goal", "met"]


def verdict_rows(sections: dict) -> list[list[str]]:
    return [[name, s.get("status", "?") + (" (earlier run)" if s.get("earlier") else ""),
             key_words(s), str(s.get("goal", "-")),
             met_word(s.get("met")) if "goal" in s else "-"]
            for name, s in sections.items()]


def verdict_table(sections: dict) -> str:
    """The plain-text table printed at the very end."""
    return "\n".join(table_lines(VERDICT_COLUMNS, verdict_rows(sections)))
