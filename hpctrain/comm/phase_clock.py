"""The step's one timer: the runner, the gradient engines and the trainer bracket each
phase (``PHASES``) with ``clock.span("forward")``; ``stop()`` turns a step's spans into
seconds per phase. Each rank's device layer holds one (``accel.clock``).

On the CPU a span's ends are host times (work runs as it is queued); on a GPU, timing
events on the compute stream, whose distance is the device's own time, so the step's
spans partition one timeline and add up. A step's events are read at the next step's end,
behind that step's wait for its gradient norm; the host waits for a step's last event
only at a log step and at the run's end. The fake device's events are host times
readable only once waited for: that proves the plumbing, not a device's concurrency.
Why, and what the fake device proves: docs/design/gpu-timing.md.
"""

from __future__ import annotations

import contextlib
import time

PHASES = ("data", "forward", "backward", "hooks", "wait", "optimizer", "bubble", "other")
"""Where a step's time goes. ``hooks`` is the part of ``backward`` that gradient hooks
spend on reductions (launching, polling; the shared-memory sums across nodes); ``wait``
is ``finish()`` completing them after backward (on one node with shared memory, all the
sums: there are no hooks there); ``other`` is the rest of the step (loss bookkeeping,
zero_grad)."""
PARTS_OF_BACKWARD = ("hooks", "weight")
"""Per-step entries that are a part of ``backward``, not beside it: the hooks, and a
zero-bubble schedule's W passes (``weight``; recorded per step, not in ``PHASES``)."""
SPANNED = tuple(p for p in PHASES if p != "other") + ("weight",)
"""What ``span()`` accepts: ``other`` is what no span covers."""
INSIDE_BACKWARD = {"weight": "backward"}
"""Spans that also count in another phase (a W pass is backward time too)."""

ANNOTATION = "phase:"
"""A span's name in a profiler trace (``phase:forward``): ``hpctrain report`` sums them."""

HOST, DEVICE_EVENTS = "host", "device events"
"""The clocks, as ``summary.json``'s ``timing.clock`` names them."""


class HostMark:
    """A point in time on the host's clock (the CPU device: work runs as it is queued)."""

    def __init__(self):
        self.t = time.perf_counter()

    def wait(self) -> None:
        """Nothing to wait for: the host has passed it."""

    def passed(self) -> bool:
        return True

    def seconds_to(self, later: HostMark) -> float:
        return later.t - self.t


class DeviceMark:
    """A timing event recorded on the current stream of a CUDA or XPU device."""

    def __init__(self, module):
        self.event = module.Event(enable_timing=True)
        self.event.record()

    def wait(self) -> None:
        self.event.synchronize()  # this event only, never the whole device

    def passed(self) -> bool:
        """Whether the device has reached it (never blocks)."""
        return self.event.query()

    def seconds_to(self, later: DeviceMark) -> float:
        return self.event.elapsed_time(later.event) / 1e3


class Span:
    """One bracketed piece of work: ``host_s`` (the host clock around it, what the
    components' own host-clock tallies add up) is set when it ends."""

    __slots__ = ("phase", "begin", "end", "host_s")

    def __init__(self, phase: str, begin):
        self.phase, self.begin, self.end, self.host_s = phase, begin, None, 0.0


class PhaseClock:
    """Spans of a step's phases on one rank, read once per step.

    ``mark``: makes a mark now (the device layer's ``mark``: host time, or an event on
    the current stream); ``name``: the clock it is (``HOST`` or ``DEVICE_EVENTS``)."""

    def __init__(self, mark, name: str):
        self.mark, self.name = mark, name
        self.annotate = None
        """While a profiler records (``train/trace.py`` sets it): a context manager
        factory that names each span in the trace, ``ANNOTATION + phase``."""
        self._spans: list[Span] = []
        self._begin = None
        self._pending: list[tuple] = []  # (begin, spans, end) of steps not read yet

    @contextlib.contextmanager
    def span(self, phase: str):
        """Bracket the work inside as ``phase`` (gradient hooks call it from autograd's
        thread: the list append is atomic)."""
        if phase not in SPANNED:
            raise ValueError(f"no phase {phase!r} (one of {', '.join(SPANNED)})")
        t0 = time.perf_counter()
        named = self.annotate(ANNOTATION + phase) if self.annotate else contextlib.nullcontext()
        in_step = self._begin is not None  # outside a step (evaluation): host time only
        s = Span(phase, self.mark() if in_step else None)
        try:
            with named:
                yield s
        finally:
            s.host_s = time.perf_counter() - t0
            if in_step:
                s.end = self.mark()
                self._spans.append(s)

    def start(self) -> None:
        """The step begins: spans from now on are its own."""
        self._spans = []
        self._begin = self.mark()

    def stop(self) -> list[dict[str, float]]:
        """The step ends. Returns the phases of the steps whose marks can be read now,
        oldest first: the earlier steps', which the device passed before this
        step's wait for its gradient norm (reading them waits for nothing), and this
        step's if the device has passed its last mark already (always on the host). A
        device's step is otherwise read at the next ``stop()`` or at ``flush()``: waiting
        for it here would hold the host while the device ends the optimizer's work, and
        leave the device idle while the host prepares the next step."""
        self._pending.append((self._begin, self._spans, self.mark()))
        self._spans, self._begin = [], None
        newest = self._pending[-1][2]
        return self.flush() if newest.passed() else self._read(self._pending[:-1])

    def flush(self) -> list[dict[str, float]]:
        """The phases of every step not yet read (waits for the last one's end: at a log
        step, and at the end of the run)."""
        return self._read(self._pending)

    def _read(self, steps: list) -> list[dict[str, float]]:
        if steps:
            steps[-1][2].wait()  # the newest end: every mark before it has passed too
        done = [self.read(*s) for s in steps]
        del self._pending[:len(steps)]
        return done

    @staticmethod
    def read(begin, spans: list[Span], end) -> dict[str, float]:
        """Seconds of each phase of one step whose marks have passed, ``weight`` (a part
        of backward) and ``step`` in all."""
        phases = {k: 0.0 for k in SPANNED}
        for s in spans:
            seconds = s.begin.seconds_to(s.end)
            phases[s.phase] += seconds
            if s.phase in INSIDE_BACKWARD:
                phases[INSIDE_BACKWARD[s.phase]] += seconds
        step = begin.seconds_to(end)
        phases["other"] = step - sum(v for k, v in phases.items()
                                     if k not in PARTS_OF_BACKWARD)
        return {**phases, "step": step}
