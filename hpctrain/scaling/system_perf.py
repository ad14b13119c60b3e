"""A system as the performance model sees it: what it needs to predict a step.

The figures are the ``[perf]`` table of the system's file (``hpctrain/systems/<name>.toml``,
read by ``hpctrain.systems.registry``; ``--system`` also takes the path of your own), in SI units,
with the ranks per node of its ``[launch]`` table. A calibration file written by
``hpctrain scale calibrate`` (JSON) replaces the numbers it measured: the compute rate per
model shape, the AdamW cost, a fitted line per collective and group size, the base memory
of a rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.scaling.comm_cost import KINDS, Fit, Link
from hpctrain.systems.registry import load_system, system_names
from hpctrain.sizes import GiB, MiB



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
    """Per dtype, FLOP/s of the matrix multiplies (wide ones: the plateau)."""
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
    collectives: str = "mpi"
    """Whose links the network figures are: ``mpi`` or ``xccl`` (the GPU's library)."""
    memory_bandwidth: float = 0.0
    """Bytes per second of device memory; 0: no memory-bound term."""
    activation_passes: float = 0.0
    """Times the activations kept for backward cross device memory in a step."""

    def calibrated(self, shape_key: str, dtype: str) -> bool:
        """Whether calibration measured this shape (its rate holds the memory-bound work)."""
        return dtype in self.shapes.get(shape_key, {})

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


def _link(link) -> Link:
    return Link(alpha_s=link.alpha_us * 1e-6, bandwidth=link.gbytes_per_s * 1e9)


def perf_system_names() -> list[str]:
    """The built-in systems with a ``[perf]`` table."""
    return [n for n in system_names() if load_system(n).perf is not None]


def load_perf(name: str, calibration: str | os.PathLike | None = None,
              collectives: str = "mpi") -> SystemPerf:
    """System ``name`` (or a .toml path) for the model, with a calibration's numbers on top.
    ``collectives``: whose links carry the gradients (``--comm.collectives``): ``mpi``,
    ``xccl`` (the GPU's library, ``[perf.network.xccl]``), or ``auto`` (the library where
    the profile has its figures, as training does on GPUs)."""
    system = load_system(name)
    p = system.perf
    if p is None:
        raise UserError(f"system {system.name} has no performance figures (no [perf] table "
                        f"in {system.file}); hpctrain plan and scale know "
                        f"{', '.join(perf_system_names())}: use one of those, or add a [perf] "
                        "table (see hpctrain/systems/polaris.toml)")
    if collectives == "xccl" and p.xccl is None:
        raise UserError(f"system {system.name} has no figures for the GPU's collective library "
                        f"([perf.network.xccl] in {system.file}); use --collectives mpi")
    intra, inter, overlap = (p.xccl if collectives != "mpi" and p.xccl
                             else (p.intra, p.inter, p.overlap))
    calib = read_calibration(calibration) if calibration else {}
    cc = calib.get("compute", {})
    perf = SystemPerf(
        name=system.name, description=system.description,
        ranks_per_node=system.launch.ranks_per_node, device=p.device,
        device_memory=p.device_memory_gib * GiB, memory_reserve=p.memory_reserve_gib * GiB,
        cores_per_node=int(calib.get("cores_per_node", p.cores_per_node)),
        flash_attention=p.flash_attention,
        base_memory=float(calib.get("base_memory_mib", p.base_memory_mib)) * MiB,
        peak_flops={k: float(v) * 1e12 for k, v in
                    {**p.peak_tflops, **cc.get("peak_tflops", {})}.items()},
        achieved_flops={k: float(v) * 1e12 for k, v in
                        {**p.achieved_tflops, **cc.get("achieved_tflops", {})}.items()},
        layer_overhead_s=float(cc.get("layer_overhead_us", p.layer_overhead_us)) * 1e-6,
        optimizer_s_per_param=float(cc.get("optimizer_ns_per_param",
                                           p.optimizer_ns_per_param)) * 1e-9,
        optimizer_overhead_s=float(cc.get("optimizer_overhead_us",
                                          p.optimizer_overhead_us)) * 1e-6,
        intra=_link(intra), inter=_link(inter),
        overlap=float(calib.get("network", {}).get("overlap", overlap)),
        collectives="xccl" if intra is not p.intra else "mpi",
        memory_bandwidth=p.memory_gbytes_per_s * 1e9, activation_passes=p.activation_passes,
        shapes=_shapes(cc.get("shapes", {})), fits=_fits(calib.get("collectives", {})),
        slowdown={int(n): {k: float(v) for k, v in d.items()}
                  for n, d in cc.get("concurrent_slowdown", {}).items()},
        source=system.source, calibration=str(calibration or ""))
    if not 0.0 <= perf.overlap <= 1.0:
        raise UserError(f"calibration file {calibration}: overlap must be between 0 and 1; "
                        "make it again with `hpctrain scale calibrate`")
    return perf


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
