"""Stopping before the job's walltime, whatever the launcher does with signals.

Not every launcher passes the scheduler's SIGTERM on in time (Open MPI's ``mpirun``
follows it with SIGKILL about two seconds later), so the trainer keeps its own clock:
the earliest of ``--train.time_limit`` after the job's start, ``$HPCTRAIN_JOB_END`` and
``$SLURM_JOB_END_TIME``. ``passed()`` is true once the time left is below a margin that
learns the longest save and step and stands in the start-up time for the shutdown; the
answer goes into the ranks' stop agreement (``stop.py``) like a signal. Runs with a time
limit should save periodically (``--train.ckpt_interval``).
The margin's formula and why: docs/design/failure-handling.md ("The trainer's own deadline").
"""

from __future__ import annotations

import collections
import os
import time

JOB_START_ENV = "HPCTRAIN_JOB_START"
JOB_END_ENV = "HPCTRAIN_JOB_END"
SLURM_END_ENV = "SLURM_JOB_END_TIME"


def process_start_time() -> float:
    """Epoch seconds when this process started (Linux /proc), else now."""
    try:
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of the whole line: start time after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _epoch(env: dict, key: str) -> float | None:
    try:
        value = float(env.get(key, ""))
    except ValueError:
        return None
    return value if value > 0 else None


class Deadline:
    def __init__(self, end: float | None, limit_s: float):
        self.end = end
        """Epoch seconds by which the job must be done (None: no deadline)."""
        self.base = min(60.0, 0.05 * limit_s) if limit_s > 0 else 60.0
        self.longest_save = 0.0
        self.shutdown = 0.0
        """Seconds the processes are expected to need after the last save."""
        self._steps: collections.deque = collections.deque(maxlen=20)

    @classmethod
    def from_config(cls, time_limit: float, env: dict | None = None) -> Deadline:
        env = os.environ if env is None else env
        start = _epoch(env, JOB_START_ENV) or process_start_time()
        ends = [start + time_limit] if time_limit > 0 else []
        ends += [e for e in (_epoch(env, JOB_END_ENV), _epoch(env, SLURM_END_ENV))
                 if e is not None]
        if not ends:
            return cls(None, time_limit)
        end = min(ends)
        return cls(end, max(0.0, end - start))

    def record_step(self, seconds: float) -> None:
        self._steps.append(seconds)

    def record_save(self, seconds: float) -> None:
        self.longest_save = max(self.longest_save, seconds)

    def record_startup(self, started: float | None = None, now: float | None = None) -> None:
        """The first step starts now: the start-up's length stands in for the shutdown."""
        started = process_start_time() if started is None else started
        self.shutdown = max(0.0, (time.time() if now is None else now) - started)

    @property
    def margin(self) -> float:
        return (self.base + 2 * self.longest_save + 2 * max(self._steps, default=0.0)
                + self.shutdown)

    def passed(self, now: float | None = None) -> bool:
        """True once the time left is less than the margin."""
        if self.end is None:
            return False
        return (time.time() if now is None else now) + self.margin >= self.end

    def describe(self) -> str:
        left = self.end - time.time() if self.end is not None else 0.0
        return (f"{left:.0f} s left, margin {self.margin:.1f} s (longest save "
                f"{self.longest_save:.1f} s, shutdown {self.shutdown:.1f} s)")
