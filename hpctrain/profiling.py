"""Profiler ranges around the phases of a step, for the device's own profiler: NVTX on
CUDA and ROCm (Nsight Systems, rocprof), ITT on XPU (VTune, unitrace) where torch has it,
nothing on the CPU.

    with profile_range("backward"):
        loss.backward()

The device layer picks the kind once per process (``comm/device.py``, when the rank's
device is chosen); a range costs a few nanoseconds when no profiler listens.
"""

from __future__ import annotations

import contextlib

_NULL = contextlib.nullcontext()
_range = None  # process-wide, as the profiler it feeds: set by use_profiler()


def use_profiler(kind: str | None) -> str | None:
    """``nvtx``, ``itt`` or None; returns the kind in use (None where unavailable)."""
    global _range
    _range = None
    import torch

    if kind == "nvtx" and torch.cuda.is_available():
        _range = torch.cuda.nvtx.range
    elif kind == "itt" and torch.profiler.itt.is_available():
        _range = torch.profiler.itt.range
    return kind if _range is not None else None


def profile_range(name: str):
    return _range(name) if _range is not None else _NULL
