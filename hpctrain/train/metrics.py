"""Throughput, model FLOP utilization (MFU) and the ``metrics.jsonl`` log."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from hpctrain.atomic import ROOM, write_failed
from hpctrain.systems.devices import device_peaks, device_table, peak_for_device
from hpctrain.train.metrics_history import set_aside_records_after

# Dense peak TFLOP/s per device and compute dtype: hpctrain/systems/devices.toml.
PEAK_TFLOPS = device_peaks()


@dataclass(frozen=True)
class Peak:
    """The rate a run's model FLOP utilization is measured against, and why that one."""
    tflops: float | None
    """Dense TFLOP/s of one device (None: unknown, no MFU is reported)."""
    basis: str
    """Which rate of the device: ``bf16``, ``tf32``, ``fp32_matrix`` or ``fp32`` (a key
    of ``devices.toml``), or ``override`` (``--train.peak_tflops``)."""
    why: str
    devices: int = 1
    """Distinct devices the job's ranks compute on (ranks sharing a GPU count once)."""

    def mfu(self, flops_per_s: float) -> float | None:
        """The job's ``flops_per_s`` over the peak of all its devices."""
        return flops_per_s / (self.tflops * 1e12 * self.devices) if self.tflops else None

    def to_dict(self) -> dict:
        return {"tflops": self.tflops, "basis": self.basis, "why": self.why,
                "devices": self.devices}


def matmul_rate_key(dtype: str, *, tf32: bool, accelerator: bool,
                    table: dict | None) -> tuple[str, str]:
    """Which ``devices.toml`` rate a run's matrix multiplies reach, and why: bf16 runs on
    the matrix units; fp32 on a GPU with ``--train.tf32`` on TF32's matrix rate where the
    device has one, else its fp32 matrix rate (``fp32_matrix``, CDNA2) or vector rate."""
    table = table or {}
    if dtype == "bf16":
        return "bf16", "bf16 compute on the matrix units"
    if accelerator and tf32 and "tf32" in table:
        return "tf32", "fp32 compute with --train.tf32: matrix multiplies in TF32"
    if accelerator and "fp32_matrix" in table:
        return "fp32_matrix", "fp32 compute on the matrix units (this device has no TF32)"
    return "fp32", ("fp32 compute with --train.tf32=false" if accelerator and not tf32
                    else "fp32 compute")


def device_peak(device_name: str, dtype: str, *, tf32: bool, accelerator: bool,
                override: float = 0.0, devices: int = 1) -> Peak:
    """The ``Peak`` of a run on ``devices`` devices the runtime calls ``device_name``
    (``Accelerator.name``). ``override`` (``--train.peak_tflops``) wins; otherwise the
    device's table in ``devices.toml`` and ``matmul_rate_key``."""
    if override > 0:
        return Peak(override, "override", "--train.peak_tflops", devices)
    found = device_table(device_name)
    if found is None:
        return Peak(None, "", f"{device_name!r} is not in devices.toml: pass "
                    "--train.peak_tflops for an MFU", devices)
    name, table = found
    key, why = matmul_rate_key(dtype, tf32=tf32, accelerator=accelerator, table=table)
    value = table.get(key)
    return Peak(float(value) if value is not None else None, key,
                f"{why}; {name} in devices.toml", devices)


def peak_tflops(device_name: str, dtype: str, override: float = 0.0) -> float | None:
    """Peak TFLOP/s of one device in ``dtype`` (a ``devices.toml`` key), or None when
    unknown; ``override`` wins."""
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
    """``metrics.jsonl``: one JSON object per line, appended by the writing rank only
    (only it creates the file).

    Whole lines only. Each record is one ``write`` of its whole line to a file opened
    for appending; a write that fails or comes up short (a full disk, a quota) is cut
    off again, back to where its line began, and stops the run with one message
    (``OutputError``). A line torn anyway (the process killed in the middle of a write)
    is repaired when a resumed run opens the file (``append``): the partial last line is
    cut, and ``notes`` says so, so that it never merges with the resumed run's first
    record."""

    def __init__(self, path: str | Path, enabled: bool, resumed_at: int = 0):
        """``resumed_at``: the step a resumed run continues from (0: a new run); records
        of later steps, from an attempt killed past its last checkpoint, are set aside."""
        self.enabled = enabled
        self.path = Path(path)
        self.notes: list[str] = []
        self._fd: int | None = None
        append = resumed_at > 0
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn = cut_torn_tail(self.path) if append else 0
            if torn:
                self.notes.append(f"warning: cut a partial last line ({torn} bytes, from a "
                                  "write that was interrupted) off the end of the file")
            moved = set_aside_records_after(self.path, resumed_at) if append else None
            if moved:
                self.notes.append(moved)
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
            self._fd = os.open(self.path, flags, 0o666)  # a resumed run appends

    def write(self, record: dict) -> None:
        if self._fd is None:
            return
        line = (json.dumps(finite_record(record), allow_nan=False) + "\n").encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            written = os.write(self._fd, line)
            if written != len(line):
                raise OSError(f"{written} of the {len(line)} bytes of a line were written")
        except OSError as e:
            with contextlib.suppress(OSError):  # what was written of the line goes again
                os.ftruncate(self._fd, start)
            raise write_failed(self.path, e, fix=RESUME) from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


RESUME = f"{ROOM}; then continue the run with --train.resume=auto"
_TAIL_READ = 1 << 16


def cut_torn_tail(path: Path) -> int:
    """Cut ``path`` back to the end of its last whole line (``\\n``); return the bytes cut
    (0: the file ends in a newline, is empty or missing)."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        keep = size
        while keep > 0:
            start = max(0, keep - _TAIL_READ)
            f.seek(start)
            chunk = f.read(keep - start)
            if keep == size and chunk.endswith(b"\n"):
                return 0
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            keep = start
        f.truncate(keep)
    return size - keep
