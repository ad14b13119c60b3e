"""Outputs written whole or not at all.

A file or directory that hpctrain publishes (``final.h5``, a merged, resharded, imported
or exported checkpoint) is written under a hidden temporary name beside its destination
and renamed into place only once complete: nobody ever reads half of one, and an output
that already exists stays as it was until its replacement is whole. A failure on the
way, above all a full disk or a quota (``ENOSPC``, ``EDQUOT``; h5py reports them as
``OSError`` or ``RuntimeError``), removes the temporary and becomes one ``OutputError``
that names the fix: one line and exit status 2, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.file_modes import chmod_as_created

ROOM = ("make room (free space, or quota: `df -h`, `quota -s`, `lfs quota`) or write "
        "somewhere else")
WRITE_FIX = f"{ROOM}; no earlier output was replaced"
WRITE_ERRORS = (OSError, RuntimeError)
"""What a failed write raises: ``OSError`` from Python, ``OSError`` or ``RuntimeError``
from h5py (``Can't write data``, with the errno in its text)."""


class OutputError(UserError):
    """An output could not be written (a full disk, a quota, permissions); ``why`` is
    the cause alone, without the output's name or the fix."""

    def __init__(self, message: str, why: str = ""):
        super().__init__(message)
        self.why = why


def describe_failure(exc: BaseException) -> str:
    """``exc`` in one line: a full disk or quota by its errno's text alone (h5py's
    message around it spans lines and names the temporary file), another ``OSError`` by
    its errno's text and file, anything else by its text with the line breaks folded."""
    for code in (errno.ENOSPC, errno.EDQUOT):
        if (isinstance(exc, OSError) and exc.errno == code) or os.strerror(code) in str(exc):
            return os.strerror(code)
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    else:
        text = str(exc)
    return " ".join(text.split()) or type(exc).__name__


def write_failed(path: str | os.PathLike, exc: BaseException,
                 fix: str = WRITE_FIX) -> OutputError:
    """The one message for a failed write of ``path``: what failed, and ``fix``."""
    why = exc.why if isinstance(exc, OutputError) else describe_failure(exc)
    return OutputError(f"writing {path} failed: {why}; {fix}", why)


def reserve_space(folder: str | os.PathLike, nbytes: int) -> None:
    """Raise the ``OSError`` of a full disk or quota now if ``folder``'s file system
    cannot take ``nbytes`` more, by allocating them (``posix_fallocate``, which counts
    against the quota too) in a hidden file that is removed again.

    For HDF5 outputs: HDF5 (2.0) reports a write that failed for want of space only when
    the file is closed, and there crashes the process (a segmentation fault, no
    message), so the room is made sure of before the first byte. A file system without
    ``fallocate`` is not checked."""
    fd, name = tempfile.mkstemp(prefix=".hpctrain-room.", suffix=".tmp", dir=folder)
    try:
        if nbytes > 0:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(fd)
        os.unlink(name)


def h5_bytes(sizes: list[int]) -> int:
    """Room to ask ``reserve_space`` for an HDF5 file of arrays of ``sizes`` bytes: those
    and, for HDF5's own records, a page per array and 64 KiB."""
    return sum(sizes) + 4096 * len(sizes) + (64 << 10)


@contextlib.contextmanager
def temporary_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file beside ``path`` to write; on success give it the mode
    ``open()`` would have (``file_modes.py``) and rename it to ``path``; on any failure remove
    it, and a failed write becomes ``write_failed``."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        yield tmp
        chmod_as_created(tmp)
        os.replace(tmp, path)
        tmp = None
    except WRITE_ERRORS as e:
        raise write_failed(path, e) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def temporary_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``path`` (which must not exist) to fill; on
    success give it and its contents the modes ``mkdir``/``open()`` would have and
    rename it to ``path``; on any failure remove it, and a failed write becomes
    ``write_failed``."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        yield tmp
        chmod_as_created(tmp)
        os.rename(tmp, path)
        tmp = None
    except (*WRITE_ERRORS, OutputError) as e:  # a file inside by its directory's name
        raise write_failed(path, e) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
