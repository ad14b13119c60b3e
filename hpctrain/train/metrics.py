"""Throughput, model FLOP utilization (MFU) and the ``metrics.jsonl`` log."""

from __future__ import annotations

import json
import math
from pathlib import Path

from hpctrain.systems.registry import device_peaks, peak_for_device

# Dense peak TFLOP/s per device and compute dtype: hpctrain/systems/devices.toml.
PEAK_TFLOPS = device_peaks()


def peak_tflops(device_name: str, dtype: str, override: float = 0.0) -> float | None:
    """Peak TFLOP/s of one device (``device_name``: the runtime's name of it, as
    ``Accelerator.name`` gives), or None when unknown (MFU is then not reported)."""
    if override > 0:
        return override
    return peak_for_device(device_name, dtype)


def finite_record(record: dict) -> dict:
    """``record`` with every NaN / inf number as ``null`` and their keys listed under
    ``"nonfinite"``: JSON has no NaN, and one such token makes a line unreadable to
    strict parsers (``jq``, browsers, pandas' ``lines=True`` with the default engine)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


class MetricsLog:
    """Appends one JSON object per line; only the writing rank creates the file."""

    def __init__(self, path: str | Path, enabled: bool, append: bool = False):
        self.enabled = enabled
        self.path = Path(path)
        self._f = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a" if append else "w")  # a resumed run appends

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(finite_record(record), allow_nan=False) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
