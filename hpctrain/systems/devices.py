"""The device table: peak TFLOP/s per device and compute dtype (``devices.toml``),
matched by the name the runtime gives a device. Read by the MFU of ``hpctrain train``
and ``hpctrain doctor``, and by the system files' ``[perf] device``."""

from __future__ import annotations

import sys
from importlib import resources

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEVICES = "devices.toml"


def _device_tables() -> dict:
    return tomllib.loads((resources.files("hpctrain.systems") / DEVICES).read_text())


def device_peaks() -> dict[str, dict[str, float]]:
    """``{device: {dtype: TFLOP/s}}`` from ``devices.toml``, in file order."""
    return {device: {dtype: float(v) for dtype, v in table.items() if dtype != "match"}
            for device, table in _device_tables().items()}


def device_table(runtime_name: str) -> tuple[str, dict] | None:
    """The first table of ``devices.toml`` one of whose ``match`` strings (default: its
    name) is part of ``runtime_name`` (``torch.cuda.get_device_name``), with its name;
    None when none matches."""
    for device, table in _device_tables().items():
        if any(m in runtime_name for m in table.get("match", [device])):
            return device, table
    return None


def peak_for_device(runtime_name: str, dtype: str) -> float | None:
    """The peak TFLOP/s in ``dtype`` of the device the runtime calls ``runtime_name``
    (``device_table``); None when no table matches or it has no figure for ``dtype``."""
    found = device_table(runtime_name)
    value = found[1].get(dtype) if found else None
    return float(value) if value is not None else None
