"""A rank's tokens on disk between tokenizing and writing (``prepare`` steps 3-6).

A rank cannot write a token before every rank has counted its tokens (the counts place
the splits and each rank's bytes in the file), so it keeps them until then. Kept in
memory they would grow with the rank's share of the input; kept here, in a hidden file
beside the output, they cost one batch of memory while being appended and are read
back through a memory map, whose pages the kernel may drop at any time. The file is
removed when ``prepare`` ends, whether it succeeded or not.
"""

from __future__ import annotations

from itertools import accumulate
from pathlib import Path

import numpy as np

from hpctrain.atomic import write_failed
from hpctrain.data.format import temp_name

SPILL_FIX = ("a rank keeps its tokens beside the output until they are written: make room "
             "there, or choose an --output on another file system")


class TokenSpill:
    """This rank's tokens, unit after unit, in one file. ``append`` while tokenizing,
    ``end_unit`` after each unit, ``seal`` once, then ``tokens(start, stop)``."""

    def __init__(self, beside: Path, dtype: np.dtype):
        """``beside``: the output file (the spill goes in its directory, hidden)."""
        self.dtype = np.dtype(dtype)
        self._made_dir = not beside.parent.exists()
        beside.parent.mkdir(parents=True, exist_ok=True)
        self.path = temp_name(beside.with_name(beside.name + ".tokens"))
        self._file = open(self.path, "wb")
        self._written = self._unit_start = 0
        self.counts: list[int] = []
        """Tokens of each unit, in the order they were appended."""
        self._map: np.ndarray | None = None

    def append(self, ids) -> None:
        """Add tokens to the current unit."""
        array = np.asarray(ids, dtype=self.dtype)
        try:
            self._file.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        except OSError as e:
            raise write_failed(self.path, e, SPILL_FIX) from None
        self._written += array.size

    def end_unit(self) -> None:
        self.counts.append(self._written - self._unit_start)
        self._unit_start = self._written

    def seal(self) -> None:
        """Finish appending; the tokens become readable."""
        try:
            self._file.close()
        except OSError as e:  # the last buffered bytes
            raise write_failed(self.path, e, SPILL_FIX) from None
        self._map = (np.memmap(self.path, dtype=self.dtype, mode="r",
                               shape=(self._written,))
                     if self._written else np.zeros(0, self.dtype))

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of everything appended (a view of the file)."""
        return self._map[start:stop]

    def unit_starts(self) -> list[int]:
        """Where each unit's tokens begin."""
        return list(accumulate(self.counts, initial=0))[:-1]

    def remove(self) -> None:
        """Close and delete the file, and the output's directory if it was made for the
        spill and nothing else is in it (safe to repeat)."""
        self._map = None
        try:
            self._file.close()
        except OSError:  # the buffered bytes had no room: the file goes anyway
            pass
        Path(self.path).unlink(missing_ok=True)
        if self._made_dir:
            try:
                self.path.parent.rmdir()
            except OSError:  # not empty: the output, or another rank's spill
                pass

