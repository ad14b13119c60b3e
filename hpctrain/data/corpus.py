"""The default corpus: a deterministic selection of the Python standard library's sources.

Every machine that runs hpctrain has these files, so ``make run`` needs no download. The
selection is the sorted list of pure-ASCII ``.py`` files of the running interpreter's
standard library (tests and vendored packages skipped), taken in order up to a byte
budget. Pure ASCII keeps the character vocabulary near 100 symbols. A different Python
version gives a slightly different corpus; the chosen files are recorded in the output.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

DEFAULT_BYTES = 4_000_000
_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "lib2to3",
               "__pycache__"}


def stdlib_files(max_bytes: int = DEFAULT_BYTES) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS & set(rel.parts[:-1]) or not path.is_file():
            continue
        data = path.read_bytes()
        if not data.isascii():
            continue
        if total + len(data) > max_bytes:
            break
        chosen.append(path)
        total += len(data)
    return chosen
