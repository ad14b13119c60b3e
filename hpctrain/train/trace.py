"""``--train.profile=STEPS``: the torch profiler around those training steps; each rank
writes ``<out_dir>/trace/rank<r>.json`` (Chrome trace JSON: Perfetto, chrome://tracing).

The profiler records host operators, and the device's kernels and copies where torch
can see them (CUDA, ROCm, XPU); no shapes, no Python stacks (they multiply a trace's
size). Each traced step is one ``ProfilerStep#N`` range, and each span of the phase clock
a ``phase:<name>`` range, which ``hpctrain report`` counts and sums
(``report/trace_summary.py``). docs/design/gpu-timing.md.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hpctrain.comm.small_collectives import barrier
from hpctrain.output_paths import RUN_TRACES as TRACE_DIR
from hpctrain.train.rundir import move_aside


def trace_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / TRACE_DIR / f"rank{rank}.json"


def activities(kind: str) -> list:
    """The profiler's activities on a device of ``kind``: the host's, and the device's
    where torch can profile it."""
    act = torch.profiler.ProfilerActivity
    found = [act.CPU]
    if kind == "cuda" and torch.cuda.is_available():
        found.append(act.CUDA)
    elif kind == "xpu" and hasattr(act, "XPU"):
        found.append(act.XPU)
    return found


class StepTrace:
    """Starts the profiler before the first traced step this run reaches and writes the
    trace after the last (or at ``close()``, when the run stopped in between)."""

    def __init__(self, steps: range, out_dir: Path, world, log, start_step: int):
        """``steps``: ``TrainConfig.traced_steps``; ``start_step``: the steps done before this run
        (a resume); ``log``: rank 0's line printer. Collective when ``steps`` is set: an
        earlier segment's traces go to ``previous-<time>/`` first (nothing is replaced)."""
        self.steps = range(max(steps.start, start_step + 1), steps.stop) if steps else steps
        self.out_dir, self.world, self.log = Path(out_dir), world, log
        self._prof = self._range = None
        if steps and not self.steps:
            log(f"trace: steps {_text(steps)} were done before this run resumed; nothing "
                "traced")
        if not self.steps:
            return
        if world.is_root and (self.out_dir / TRACE_DIR).exists():
            dest = move_aside(self.out_dir, [TRACE_DIR])
            log(f"trace: an earlier run's traces moved into {dest}/")
        barrier(world.comm, timeout=world.timeout, what="moving earlier traces aside")

    def before(self, done: int) -> None:
        """Before 1-based step ``done`` runs: the profiler started at the first traced
        step, and the step's range (``ProfilerStep#<done>``, as torch names its own)."""
        if self.steps and done == self.steps.start:
            self._prof = torch.profiler.profile(activities=activities(self.world.accel.kind),
                                                record_shapes=False, with_stack=False)
            self._prof.start()
            self.world.accel.clock.annotate = torch.profiler.record_function
        if self._prof is not None:
            self._range = torch.profiler.record_function(f"ProfilerStep#{done}")
            self._range.__enter__()

    def after(self, done: int) -> None:
        """After 1-based step ``done``: its range closed, and after the last traced step
        the trace written."""
        if self._prof is None:
            return
        self._end_range()
        if done == self.steps[-1]:
            self._write(self.steps)

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def close(self, done: int) -> None:
        """The run ends after step ``done``: a trace still open is written with the steps
        it has."""
        if self._prof is not None:
            self._end_range()
            self._write(range(self.steps.start, done + 1))

    def _write(self, steps: range) -> None:
        prof, self._prof = self._prof, None
        self.world.accel.clock.annotate = None
        prof.stop()
        path = trace_path(self.out_dir, self.world.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.log(f"trace: steps {_text(steps)} in {path.parent}/rank<r>.json, one per rank "
                 "(open in https://ui.perfetto.dev; `hpctrain report` summarises them)")


def _text(steps: range) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else f"{steps[0]}"
