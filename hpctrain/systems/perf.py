"""A system's performance figures (``[perf]`` of its file) as the model uses them, in SI
units: seconds, bytes, bytes per second, FLOP/s.

The file's units (``alpha_us``, ``gbytes_per_s``, ``*_gib``, ``*_tflops``) are converted
once, where the file is read (``hpctrain.systems.registry``); a calibration
(``hpctrain.scaling.system_perf.load_perf``) replaces the figures it measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hpctrain.errors import UserError


@dataclass(frozen=True)
class Link:
    """One level of the network: latency per message and achieved bandwidth."""

    alpha_s: float
    bandwidth: float
    """Bytes per second one rank can push through this level (achieved, not the data sheet)."""


@dataclass(frozen=True)
class Fit:
    """A measured line ``t = alpha_s + beta_s_per_byte * n`` for one collective and size."""

    alpha_s: float
    beta_s_per_byte: float

    def time(self, n_bytes: float) -> float:
        return self.alpha_s + self.beta_s_per_byte * n_bytes


@dataclass(frozen=True)
class ShapeRate:
    """Measured compute of one model shape: t_micro = layers * overhead + FLOPs / rate."""

    flops_per_s: float
    layer_overhead_s: float


@dataclass(frozen=True)
class FileSystem:
    """Where checkpoints go (``[perf.filesystem]``): the parallel file system's write rates
    and the rate at which a rank copies its state into host memory."""

    name: str
    write_bandwidth: float
    """Bytes per second the whole file system absorbs (every client together)."""
    node_write_bandwidth: float
    """Bytes per second one node's clients can write (its network links cap it)."""
    host_copy_bandwidth: float
    """Bytes per second one rank copies its state from the device into host memory."""


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
    """Per device and dtype, FLOP/s (``devices.toml``, for MFU)."""
    achieved_flops: dict
    """Per dtype, FLOP/s of the matrix multiplies (wide ones: the plateau) when
    ``memory_bandwidth`` is given; without it, the whole forward + backward rate (the
    planner warns which). Never above the device's peak (``load_perf`` refuses it)."""
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
    xccl: tuple | None = None
    """``(intra, inter, overlap)`` of the GPU's collective library
    (``[perf.network.xccl]``, for ``--comm.collectives=xccl``); None: not known."""
    filesystem: FileSystem | None = None
    """``[perf.filesystem]``, for the checkpoint term (``hpctrain plan --ckpt-interval``);
    None: not known."""

    def calibrated(self, shape_key: str, dtype: str) -> bool:
        """Whether calibration measured this shape (its rate holds the memory-bound work)."""
        return dtype in self.shapes.get(shape_key, {})

    def compute_rate(self, shape_key: str, dtype: str) -> ShapeRate:
        """The measured rate of this shape if calibrated, else the system file's."""
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
