"""Performance profiles of systems, as data: what the model needs to predict a step.

Profiles are TOML files in ``hpctrain/scaling/systems/`` (``polaris``, ``aurora``,
``local``); ``--system`` also takes the path of your own. A calibration file written by
``hpctrain scale calibrate`` (JSON) names its base profile and replaces the numbers it
measured: the compute rate per model shape, the AdamW cost, a fitted line per collective
and group size, the base memory of a rank.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.scaling.collectives import KINDS, Fit, Link

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class ShapeRate:
    """Measured compute of one model shape: t_micro = layers * overhead + FLOPs / rate."""

    flops_per_s: float
    layer_overhead_s: float


@dataclass(frozen=True)
class SystemPerf:
    name: str
    description: str
    ranks_per_node: int
    """0: a single machine that holds every rank (local studies)."""
    device: str
    device_memory: float
    """Bytes per rank's device; 0 = shared host memory (no fit check per device)."""
    memory_reserve: float
    cores_per_node: int
    """CPU ranks share these cores (oversubscription); 0 = accelerators, never shared."""
    flash_attention: bool
    base_memory: float
    peak_flops: dict
    """Per device and dtype, FLOP/s (for MFU)."""
    achieved_flops: dict
    layer_overhead_s: float
    optimizer_s_per_param: float
    optimizer_overhead_s: float
    intra: Link
    inter: Link
    overlap: float
    shapes: dict = field(default_factory=dict)
    """``{shape key: {dtype: ShapeRate}}`` from calibration."""
    fits: dict = field(default_factory=dict)
    """``{group size: {kind: Fit}}`` measured collectives (calibration)."""
    slowdown: dict = field(default_factory=dict)
    """``{ranks on the node: {shape key or "mean": factor}}``: how much slower a rank's
    forward + backward + synchronization runs when that many ranks share the cores."""
    source: str = ""
    calibration: str = ""

    def compute_rate(self, shape_key: str, dtype: str) -> ShapeRate:
        """The measured rate of this shape if calibrated, else the profile's."""
        rate = self.shapes.get(shape_key, {}).get(dtype)
        if rate is not None:
            return rate
        if dtype not in self.achieved_flops:
            raise UserError(f"system {self.name} has no compute rate for {dtype}; "
                            f"use one of {', '.join(self.achieved_flops)}")
        return ShapeRate(self.achieved_flops[dtype], self.layer_overhead_s)

    def shared_core_slowdown(self, ranks_on_node: int, shape_key: str) -> float | None:
        by_shape = self.slowdown.get(ranks_on_node) or {}
        return by_shape.get(shape_key, by_shape.get("mean"))

    def fit(self, kind: str, group: int) -> Fit | None:
        return self.fits.get(group, {}).get(kind)

    def cores(self) -> int:
        if self.cores_per_node:
            return self.cores_per_node
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)


def system_names() -> list[str]:
    folder = resources.files("hpctrain.scaling").joinpath("systems")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def _read_profile(name: str) -> tuple[dict, str]:
    path = Path(name)
    if name.endswith(".toml"):
        if not path.is_file():
            raise UserError(f"system profile {name} does not exist; copy one of "
                            f"hpctrain/scaling/systems/*.toml and edit it")
        return tomllib.loads(path.read_text()), str(path)
    if name not in system_names():
        raise UserError(f"unknown system {name!r} for the performance model; use one of "
                        f"{', '.join(system_names())}, or the path of a .toml profile")
    text = resources.files("hpctrain.scaling").joinpath("systems").joinpath(f"{name}.toml").read_text()
    return tomllib.loads(text), name


def _link(d: dict, what: str) -> Link:
    try:
        return Link(alpha_s=float(d["alpha_us"]) * 1e-6, bandwidth=float(d["gbytes_per_s"]) * 1e9)
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{what} needs alpha_us and gbytes_per_s numbers") from None


def load_system(name: str, calibration: str | os.PathLike | None = None) -> SystemPerf:
    """The profile ``name`` (or a .toml path), with a calibration file's numbers on top."""
    d, source = _read_profile(name)
    calib: dict = {}
    if calibration:
        calib = read_calibration(calibration)
    try:
        c, n = d["compute"], d["network"]
        cc = calib.get("compute", {})
        system = SystemPerf(
            name=d["name"], description=d.get("description", ""),
            ranks_per_node=int(d["ranks_per_node"]), device=d.get("device", ""),
            device_memory=float(d["device_memory_gib"]) * GIB,
            memory_reserve=float(d.get("memory_reserve_gib", 0.0)) * GIB,
            cores_per_node=int(calib.get("cores_per_node", d.get("cores_per_node", 0))),
            flash_attention=bool(d.get("flash_attention", False)),
            base_memory=float(calib.get("base_memory_mib", d.get("base_memory_mib", 0))) * MIB,
            peak_flops={k: float(v) * 1e12 for k, v in
                        {**c["peak_tflops"], **cc.get("peak_tflops", {})}.items()},
            achieved_flops={k: float(v) * 1e12 for k, v in
                            {**c["achieved_tflops"], **cc.get("achieved_tflops", {})}.items()},
            layer_overhead_s=float(cc.get("layer_overhead_us", c["layer_overhead_us"])) * 1e-6,
            optimizer_s_per_param=float(cc.get("optimizer_ns_per_param",
                                               c["optimizer_ns_per_param"])) * 1e-9,
            optimizer_overhead_s=float(cc.get("optimizer_overhead_us",
                                              c["optimizer_overhead_us"])) * 1e-6,
            intra=_link(n["intra"], f"{source}: [network] intra"),
            inter=_link(n["inter"], f"{source}: [network] inter"),
            overlap=float(calib.get("network", {}).get("overlap", n.get("overlap", 0.0))),
            shapes=_shapes(cc.get("shapes", {})), fits=_fits(calib.get("collectives", {})),
            slowdown={int(n): {k: float(v) for k, v in d.items()}
                      for n, d in cc.get("concurrent_slowdown", {}).items()},
            source=source, calibration=str(calibration or ""))
    except KeyError as e:
        raise UserError(f"system profile {source} lacks {e.args[0]!r}; compare it with "
                        "hpctrain/scaling/systems/polaris.toml") from None
    if not 0.0 <= system.overlap <= 1.0:
        raise UserError(f"system profile {source}: overlap must be between 0 and 1")
    return system


def read_calibration(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"calibration file {p} does not exist; make it with "
                        f"`hpctrain scale calibrate --output {p}`")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"calibration file {p} is not valid JSON ({e}); make it again with "
                        "`hpctrain scale calibrate`") from None
    if data.get("schema") != 1:
        raise UserError(f"calibration file {p} has an unknown schema; make it again with "
                        "`hpctrain scale calibrate`")
    return data


def _shapes(d: dict) -> dict:
    return {key: {dtype: ShapeRate(float(r["tflops"]) * 1e12, float(r["layer_overhead_us"]) * 1e-6)
                  for dtype, r in by_dtype.items()} for key, by_dtype in d.items()}


def _fits(d: dict) -> dict:
    out = {}
    for group, kinds in d.items():
        out[int(group)] = {k: Fit(float(v["alpha_us"]) * 1e-6, float(v["ns_per_byte"]) * 1e-9)
                           for k, v in kinds.items() if k in KINDS}
    return out
