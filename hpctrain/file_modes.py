"""File modes that follow the user's umask.

Files written through a temporary name (``tempfile.mkstemp`` / ``mkdtemp``, then a
rename into place) are created 0600 / 0700 whatever the umask says, so teammates on a
shared project filesystem could not read a dataset or a checkpoint, and the mode would
depend on which code path wrote the file. Everything we publish gets the mode ``open()``
or ``mkdir()`` would have given it: 0666 / 0777 less the umask.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask, read without changing it (``os.umask`` sets it, which would
    race with a thread that creates a file at that moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the brief set-and-restore
    os.umask(mask)
    return mask


def file_mode() -> int:
    return 0o666 & ~umask()


def dir_mode() -> int:
    return 0o777 & ~umask()


def chmod_as_created(path: str | Path) -> None:
    """Give ``path`` (a file, or a directory and everything under it) the mode a plain
    ``open()`` / ``mkdir()`` would have given it under this umask."""
    path = Path(path)
    if not path.is_dir():
        os.chmod(path, file_mode())
        return
    os.chmod(path, dir_mode())
    for sub, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(Path(sub) / d, dir_mode())
        for f in files:
            os.chmod(Path(sub) / f, file_mode())
