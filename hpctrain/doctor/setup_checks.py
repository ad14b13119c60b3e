"""The doctor's checks of how the node is set up, each a mistake that runs but runs slow:
ranks sharing a GPU, a rank bound to cores far from its GPU (another NUMA node), MPI
answering "not GPU-aware" where the system's file turns GPU support on, pip's MPICH
on a system whose site MPI mpi4py should be built against, and a CPU-only torch on a
node with GPUs. Each rule is a small function of facts, so the tests plant each one."""

from __future__ import annotations

import os
from pathlib import Path

from hpctrain.doctor.node_check import NodeCheck

GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/kfd")
"""What the kernel shows of NVIDIA and AMD GPUs whatever torch sees (an Intel GPU's render
node looks like an integrated one's: not told apart here)."""


def expand_cpus(text: str) -> set[int]:
    """``0-2,5`` -> ``{0, 1, 2, 5}`` (the kernel's cpulist format)."""
    out: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def gpu_numa_cpus(accel) -> set[int] | None:
    """The CPUs of the NUMA node a CUDA/ROCm device hangs off (sysfs), or None when the
    runtime or the kernel does not say."""
    if accel.kind != "cuda":
        return None
    props = accel.module.get_device_properties(accel.index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    address = (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
               f"{getattr(props, 'pci_device_id', 0):02x}.0")
    try:
        node = int(Path(f"/sys/bus/pci/devices/{address}/numa_node").read_text())
        if node < 0:
            return None
        return expand_cpus(Path(f"/sys/devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None


def gpus_present() -> list[str]:
    """Device files of GPUs on this node, whatever torch sees."""
    return [path for path in GPU_DEVICE_FILES if os.path.exists(path)]


def torch_gpu_build() -> str | None:
    """The GPU runtime this torch was built for (CUDA, ROCm, XPU), None for a CPU wheel."""
    import torch

    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    xpu = getattr(torch, "xpu", None)
    return "XPU" if xpu is not None and xpu.is_available() else None


def pip_mpich(library_version: str) -> bool:
    """Whether the MPI library is the ``mpich`` wheel from PyPI (it says so)."""
    return "pypi.org/p/mpich" in library_version


def setup_failures(rows: list[dict], *, library_version: str, aware: bool | None,
                   system) -> list[tuple[str, str]]:
    """``(check, why)`` for each mistake, from every rank's row (``check_ranks``), the
    MPI library's version text, whether MPI takes this device's memory (None: no GPU),
    and the job's system (None: not a job of a known system)."""
    out = []
    shared: dict = {}
    for r in rows:
        if r.get("device_id"):
            shared.setdefault((r["host"], r["device_id"]), []).append(r["rank"])
    crowded = [f"ranks {', '.join(map(str, ranks))} on {host}'s {rows[ranks[0]]['device']}"
               for (host, _), ranks in shared.items() if len(ranks) > 1]
    if crowded:
        out.append(("devices", "ranks share a GPU (" + "; ".join(crowded[:4]) + "): one rank "
                    "per GPU, i.e. ranks per node = GPUs per node, each bound to its own "
                    "(hpctrain jobscript does both)"))
    far = [f"rank {r['rank']} (cpus {r['cpus']}, its GPU's NUMA node has {r['gpu_cpus']})"
           for r in rows if r.get("gpu_cpus") and r.get("cpus")
           and not expand_cpus(r["cpus"]) & expand_cpus(r["gpu_cpus"])]
    if far:
        out.append(("numa", "ranks run on cores of another NUMA node than their GPU: "
                    + "; ".join(far[:4]) + "; bind each rank next to its GPU (the system "
                    "file's device_order, --cpu-bind)"))
    if system is not None and aware is False and system.launch.expects_gpu_aware_mpi:
        out.append(("gpu_aware", f"MPI says it cannot read this GPU's memory, but the "
                    f"{system.name} system file turns GPU support on: build mpi4py against "
                    f"{system.launch.vendor_mpi or 'the site MPI'} with its GPU library "
                    "linked (docs/systems/mpi.md)"))
    if system is not None and system.launch.vendor_mpi and pip_mpich(library_version):
        out.append(("mpi", f"pip's mpich wheel runs on {system.name}, whose MPI is "
                    f"{system.launch.vendor_mpi}: pip uninstall mpich and build mpi4py "
                    "against the system MPI (make install MPI_PACKAGES=\"--no-binary "
                    "mpi4py mpi4py\", docs/systems/mpi.md)"))
    bare = [r for r in rows if r.get("gpu_files") and not r.get("torch_gpu")]
    if bare:
        out.append(("torch", f"GPUs are on this node ({', '.join(bare[0]['gpu_files'][:2])}) "
                    "but torch is a CPU-only build: install the GPU build of torch the site "
                    "recommends (make gpu-check installs one)"))
    return out


def check_setup(world, result: NodeCheck, rows: list[dict] | None, system) -> None:
    """Record each mistake of ``setup_failures`` (rank 0 holds the rows)."""
    from mpi4py import MPI

    if not world.is_root:
        return
    aware = world.gpu_aware.direct if world.accel.is_accelerator else None
    failures = setup_failures(rows or [], library_version=MPI.Get_library_version(),
                              aware=aware, system=system)
    result.sections["setup"] = {"system": system.name if system else None,
                                "problems": [f"{c}: {w}" for c, w in failures]}
    for check, why in failures:
        result.fail(check, why)
