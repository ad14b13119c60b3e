"""A dependency-free progress bar for rank 0.

On a terminal it redraws one line; in a batch job's log file (not a TTY) it prints a
plain line every ``min_interval_s`` seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, desc: str = "", enabled: bool = True, stream=None,
                 min_interval_s: float = 0.2, width: int = 24):
        self.total, self.desc, self.enabled = max(total, 0), desc, enabled
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval_s = min_interval_s if self.tty else max(min_interval_s, 10.0)
        self.width = width
        self.count = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, text: str = "", force: bool = False) -> None:
        self.count += n
        now = time.perf_counter()
        if not self.enabled or (not force and now - self._last < self.min_interval_s
                                and self.count < self.total):
            return
        self._last = now
        frac = self.count / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        line = (f"{self.desc} [{bar}] {self.count}/{self.total} "
                f"{_fmt_time(elapsed)}<{_fmt_time(eta)} {text}")
        if self.tty:
            self.stream.write("\r" + line.ljust(100)[:160])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def write(self, line: str) -> None:
        """Print a line above the bar (logs, eval results)."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(line + "\n")
        self.stream.flush()


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"
