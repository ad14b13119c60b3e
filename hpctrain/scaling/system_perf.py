"""A system as the performance model sees it: what it needs to predict a step.

The figures are the ``[perf]`` table of the system's file (``hpctrain/systems/<name>.toml``,
read by ``hpctrain.systems.registry`` into a ``SystemPerf`` in SI units, with the ranks per
node of its ``[launch]`` table; ``--system`` also takes the path of your own). A
calibration file written by ``hpctrain scale calibrate`` (JSON) replaces the numbers it
measured: the compute rate per model shape, the AdamW cost, a fitted line per collective
and group size, the base memory of a rank.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.scaling.comm_cost import KINDS
from hpctrain.sizes import MiB
from hpctrain.systems.perf import Fit, ShapeRate, SystemPerf
from hpctrain.systems.registry import load_system, system_names

__all__ = ["ShapeRate", "SystemPerf", "load_perf", "perf_system_names", "read_calibration"]


def perf_system_names() -> list[str]:
    """The built-in systems with a ``[perf]`` table."""
    return [n for n in system_names() if load_system(n).perf is not None]


def load_perf(name: str, calibration: str | os.PathLike | None = None,
              collectives: str = "mpi", checkpoints: bool = False) -> SystemPerf:
    """System ``name`` (or a .toml path) for the model, with a calibration's numbers on top.
    ``collectives``: whose links carry the gradients (``--comm.collectives``): ``mpi``,
    ``xccl`` (the GPU's library, ``[perf.network.xccl]``), or ``auto`` (the library where
    the system has its figures, as training does on GPUs). ``name`` may be a folder
    holding one system file (or ``system.toml``). ``checkpoints``: the checkpoint term is
    wanted (a file without ``[perf.filesystem]`` gets a warning)."""
    system = load_system(system_file(name))
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
    us = {k: float(cc[k]) * 1e-6 for k in ("layer_overhead_us", "optimizer_overhead_us")
          if k in cc}
    perf = replace(
        p, cores_per_node=int(calib.get("cores_per_node", p.cores_per_node)),
        base_memory=(float(calib["base_memory_mib"]) * MiB if "base_memory_mib" in calib
                     else p.base_memory),
        peak_flops={**p.peak_flops, **_flops(cc.get("peak_tflops", {}))},
        achieved_flops={**p.achieved_flops, **_flops(cc.get("achieved_tflops", {}))},
        layer_overhead_s=us.get("layer_overhead_us", p.layer_overhead_s),
        optimizer_s_per_param=(float(cc["optimizer_ns_per_param"]) * 1e-9
                               if "optimizer_ns_per_param" in cc else p.optimizer_s_per_param),
        optimizer_overhead_s=us.get("optimizer_overhead_us", p.optimizer_overhead_s),
        intra=intra, inter=inter,
        overlap=float(calib.get("network", {}).get("overlap", overlap)),
        collectives="xccl" if intra is not p.intra else "mpi",
        shapes=_shapes(cc.get("shapes", {})), fits=_fits(calib.get("collectives", {})),
        slowdown={int(n): {k: float(v) for k, v in d.items()}
                  for n, d in cc.get("concurrent_slowdown", {}).items()},
        calibration=str(calibration or ""))
    _check_rates(perf, system.file)
    if not calibration:
        _warn_missing(perf, system.file, collectives)
    if checkpoints:
        _warn_no_filesystem(perf, system.file)
    if not 0.0 <= perf.overlap <= 1.0:
        raise UserError(f"calibration file {calibration}: overlap must be between 0 and 1; "
                        "make it again with `hpctrain scale calibrate`")
    return perf


def system_file(name: str) -> str:
    """``--system``: a built-in name, a file, or a folder holding one system file."""
    folder = Path(name)
    if not folder.is_dir():
        return name
    if (folder / "system.toml").is_file():
        return str(folder / "system.toml")
    files = sorted(folder.glob("*.toml"))
    if len(files) != 1:
        raise UserError(f"--system {name}: a folder must hold one system file (or "
                        f"system.toml); it holds {len(files)} .toml file(s)"
                        + (f" ({', '.join(f.name for f in files)}): name one" if files else ""))
    return str(files[0])


def _check_rates(perf: SystemPerf, file: str) -> None:
    """``achieved_tflops`` is what the matrix multiplies reach, never more than the
    device's peak (``devices.toml``)."""
    for dtype, rate in perf.achieved_flops.items():
        peak = perf.peak_flops.get(dtype)
        if peak and rate > peak:
            raise UserError(f"system file {file}: [perf.compute] achieved_tflops {dtype} = "
                            f"{rate / 1e12:g} is above the {perf.device} peak "
                            f"({peak / 1e12:g}); give the rate the matrix multiplies reach")


_WARNED: set = set()


def _warn_missing(perf: SystemPerf, file: str, collectives: str) -> None:
    """One line on stderr per table a GPU system's file lacks and what the model assumes
    instead (once per file and key in a process)."""
    if perf.device.startswith("cpu") or perf.cores_per_node:
        return
    lines = []
    if not perf.memory_bandwidth:
        lines.append(("memory_gbytes_per_s", "[perf.compute] has no memory_gbytes_per_s: "
                      "the model takes achieved_tflops as the whole forward + backward rate "
                      "(no memory-bound term for the activations)"))
    if perf.xccl is None and collectives == "auto":
        lines.append(("xccl", "no [perf.network.xccl]: collectives are priced with "
                      "[perf.network]'s MPI links and overlap, not the GPU's library"))
    for key, text in lines:
        warn_once(file, key, text)


def warn_once(file: str, key: str, text: str) -> None:
    """``warning: system file FILE: TEXT`` on stderr, once per file and key in a process."""
    if (file, key) not in _WARNED:
        _WARNED.add((file, key))
        print(f"warning: system file {file}: {text}", file=sys.stderr)


def _warn_no_filesystem(perf: SystemPerf, file: str) -> None:
    """The checkpoint term's one line for a system file without ``[perf.filesystem]``."""
    if perf.filesystem is None:
        warn_once(file, "filesystem", "no [perf.filesystem]: checkpoint writes are "
                  "priced at the [perf.network] inter link's rate per node with no file-system "
                  "limit, the host copy at memory_gbytes_per_s (or that link's rate)")


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


def _flops(tflops: dict) -> dict:
    return {k: float(v) * 1e12 for k, v in tflops.items()}


def _shapes(d: dict) -> dict:
    return {key: {dtype: ShapeRate(float(r["tflops"]) * 1e12, float(r["layer_overhead_us"]) * 1e-6)
                  for dtype, r in by_dtype.items()} for key, by_dtype in d.items()}


def _fits(d: dict) -> dict:
    out = {}
    for group, kinds in d.items():
        out[int(group)] = {k: Fit(float(v["alpha_us"]) * 1e-6, float(v["ns_per_byte"]) * 1e-9)
                           for k, v in kinds.items() if k in KINDS}
    return out
