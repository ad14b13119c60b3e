"""A real full disk for tests: a small tmpfs mounted on a fresh directory.

Writes into it fail the way they do on a cluster's full scratch or exceeded quota
(``ENOSPC`` from the kernel, through Python, h5py and MPI-IO alike), which no
injection at one call reaches. Mounting needs root and ``mount(8)``; elsewhere the
tests that need it skip with the reason, and injected failures cover the same code.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


@contextlib.contextmanager
def small_filesystem(size: str):
    """A tmpfs of ``size`` (``"1m"``, ``"256k"``) mounted on a fresh directory; yields
    its path, or None (with the reason in ``small_filesystem.why``) where this process
    may not mount one. Unmounted and removed at the end."""
    point = Path(tempfile.mkdtemp(prefix="hpctrain-full-"))
    p = None
    if shutil.which("mount") and os.geteuid() == 0:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs",
                            str(point)], capture_output=True, text=True)
    if p is None or p.returncode:
        small_filesystem.why = ("mounting a tmpfs needs root and mount(8)" if p is None
                                else f"mount failed: {p.stderr.strip()}")
        point.rmdir()
        yield None
        return
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
        point.rmdir()


def fill(folder: Path, leave: int = 0) -> None:
    """Fill the file system of ``folder`` until at most ``leave`` bytes are free (a file
    ``filler`` in ``folder``)."""
    with open(folder / "filler", "wb") as f:
        block = b"\0" * 4096
        try:
            while shutil.disk_usage(folder).free > leave:
                f.write(block)
                f.flush()
        except OSError:
            pass
