"""The shape of the package's code (../shared/STYLE.md: small files with one concern): no
function in ``hpctrain/`` longer than MAX_FUNCTION_LINES unless a reason is written next
to it, and no module longer than MAX_MODULE_LINES (or its TIGHTER_LIMITS entry). A long function hides its steps; split
it into named helpers that the top function calls in order."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hpctrain"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450

COMMENT_MARKER = re.compile(r"#\s*long:\s*\S")
DOCSTRING_MARKER = re.compile(r"(?m)^\s*long:\s*\S")
"""A function may pass MAX_FUNCTION_LINES with its reason: ``# long: <reason>`` on the
line above its ``def`` (above its decorators, if any), or a docstring line
``long: <reason>``."""

LONG_MODULES: dict[str, str] = {}
"""Modules allowed past MAX_MODULE_LINES for now (path under hpctrain/ -> why)."""

TIGHTER_LIMITS: dict[str, tuple[int, str]] = {
    "train/trainer.py": (300, "the trainer only composes (batches -> runner.train_step -> "
                              "engine.step -> metrics / eval / checkpoint); how a run "
                              "ends is run_end.py's, its outputs outputs.py's"),
}
"""Modules held below MAX_MODULE_LINES (path under hpctrain/ -> (lines, why))."""


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, line of the ``def``, lines) of every function in ``source`` longer than
    ``limit`` lines without a ``long:`` reason; nested functions and methods included."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if length <= limit:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        above = lines[first - 2] if first >= 2 else ""
        if COMMENT_MARKER.search(above) or DOCSTRING_MARKER.search(ast.get_docstring(node) or ""):
            continue
        found.append((node.name, node.lineno, length))
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_function_is_longer_than_the_limit_without_a_reason():
    offenders = [f"hpctrain/{_name(path)}:{line} {name}() has {length} lines"
                 for path in _modules()
                 for name, line, length in long_functions(path.read_text())]
    assert not offenders, (
        f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(offenders) +
        "\nsplit each into well-named steps, or write '# long: <reason>' above its def")


def test_no_module_is_longer_than_the_limit():
    offenders = [f"hpctrain/{_name(path)} has {_lines(path)} lines" for path in _modules()
                 if _name(path) not in LONG_MODULES and _lines(path) > MAX_MODULE_LINES]
    assert not offenders, (
        f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(offenders) +
        "\nsplit each by concern (a file per concern)")


def test_modules_with_a_tighter_limit_keep_to_it():
    offenders = [f"hpctrain/{name} has {_lines(PACKAGE / name)} lines, over {limit}: {why}"
                 for name, (limit, why) in TIGHTER_LIMITS.items()
                 if _lines(PACKAGE / name) > limit]
    assert not offenders, "\n".join(offenders) + "\nmove what is not composition out"


def test_every_long_module_exemption_is_still_needed():
    stale = [name for name in LONG_MODULES
             if not (PACKAGE / name).is_file() or _lines(PACKAGE / name) <= MAX_MODULE_LINES]
    assert not stale, f"drop these from LONG_MODULES (split, renamed or short now): {stale}"


def _function(lines: int, above: str = "", decorator: str = "", docstring: str = "") -> str:
    """A function of exactly ``lines`` lines, with what stands above and in it."""
    head = [above, decorator] if decorator else [above]
    body = [f'    """{docstring}"""'] if docstring else []
    body += ["    x = 0"] * (lines - 2 - len(body)) + ["    return x"]
    return "\n".join([*head, "def f():", *body]) + "\n"


@pytest.mark.parametrize("source, flagged", [
    (_function(MAX_FUNCTION_LINES), False),
    (_function(MAX_FUNCTION_LINES + 1), True),
    (_function(MAX_FUNCTION_LINES + 1, above="# long: a table of cases, one per line"), False),
    (_function(MAX_FUNCTION_LINES + 1, above="# long:"), True),  # a marker needs its reason
    (_function(MAX_FUNCTION_LINES + 1, above="# long: generated", decorator="@staticmethod"),
     False),
    (_function(MAX_FUNCTION_LINES + 1, decorator="@staticmethod"), True),
    (_function(MAX_FUNCTION_LINES + 1, docstring="What it does.\n    long: one state machine"),
     False),
    (textwrap.dedent("""\
        class C:
            def method(self):
        """) + "".join("        x = 0\n" for _ in range(MAX_FUNCTION_LINES)), True),
])
def test_the_checker_flags_long_functions_without_a_reason(source, flagged):
    assert bool(long_functions(source)) is flagged
