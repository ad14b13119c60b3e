"""NVTX ranges for Nsight Systems, free when the optional ``nvtx`` package is absent.

    with nvtx_range("backward"):
        loss.backward()
"""

from __future__ import annotations

import contextlib

try:  # the optional extra `hpctrain[nvtx]`
    import nvtx as _nvtx
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx = None

_NULL = contextlib.nullcontext()


def nvtx_range(name: str):
    return _nvtx.annotate(name) if _nvtx is not None else _NULL


def nvtx_available() -> bool:
    return _nvtx is not None
