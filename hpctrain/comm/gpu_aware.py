"""Whether MPI may read and write this rank's device memory directly ("GPU-aware" MPI).

Asked per vendor (``cuda``, ``hip``, ``ze``) of the library loaded in this process,
before any environment variable is believed: MPICH 4+ through its ``MPIX`` queries, HPE
Cray MPICH by its GTL library loaded *and* ``MPICH_GPU_SUPPORT_ENABLED=1``, Open MPI
through its queries (but its nonblocking reductions on device memory are always staged,
ompi#9845), MVAPICH2-GDR by ``MV2_USE_CUDA=1``. A device pointer handed to an MPI that
cannot read it crashes, while staging only costs copies, so anything uncertain answers
no. ``--comm.gpu_aware=yes|no`` overrides the answer (not Open MPI's reduction limit).
Each library's test and why: docs/design/devices.md ("Device memory to MPI").
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

SETTINGS = ("auto", "yes", "no")
# MPIX_GPU_query_support's type argument (MPICH's mpi_proto.h: MPIX_GPU_SUPPORT_*).
MPICH_GPU_TYPE = {"cuda": 0, "ze": 1, "hip": 2}
# Per-vendor queries, in the order asked (Open MPI spells HIP "rocm").
QUERIES = {"cuda": ("MPIX_Query_cuda_support",),
           "ze": ("MPIX_Query_ze_support",),
           "hip": ("MPIX_Query_hip_support", "MPIX_Query_rocm_support")}
CRAY_GTL = {"cuda": "libmpi_gtl_cuda", "hip": "libmpi_gtl_hsa", "ze": "libmpi_gtl_ze"}
VENDOR_NAMES = {"cuda": "CUDA", "hip": "ROCm", "ze": "Level Zero"}


@dataclass(frozen=True)
class GPUAwareness:
    direct: bool
    """Device buffers go to MPI as they are; otherwise through host staging buffers."""
    reason: str
    reductions: bool = True
    """Nonblocking and persistent reductions may take device memory too (not Open MPI)."""

    def __bool__(self) -> bool:
        return self.direct

    def __str__(self) -> str:
        if not self.direct:
            return f"no ({self.reason}; device buffers are staged through host memory)"
        limit = "" if self.reductions else "; nonblocking reductions staged through host"
        return f"yes ({self.reason}{limit})"


HOST_MEMORY = GPUAwareness(False, "host memory: nothing to decide")


@dataclass(frozen=True)
class LibraryFacts:
    """What the MPI library in this process says about itself."""
    family: str
    """``mpich``, ``cray-mpich``, ``open-mpi``, ``mvapich``, ``intel-mpi`` or ``other``."""
    queries: dict = field(default_factory=dict)
    """``{function name: answer}`` for each GPU query the library exports; for
    ``MPIX_GPU_query_support`` one entry per vendor, ``MPIX_GPU_query_support(<id>)``."""
    gtl: tuple = ()
    """Cray GTL libraries mapped into this process."""


def library_family(version_text: str) -> str:
    text = version_text.lower()
    for needle, family in (("cray mpich", "cray-mpich"), ("open mpi", "open-mpi"),
                           ("mvapich", "mvapich"), ("intel(r) mpi", "intel-mpi"),
                           ("mpich", "mpich")):
        if needle in text:
            return family
    return "other"


def read_library_facts() -> LibraryFacts:
    """Ask the loaded library (through mpi4py's extension module, whose symbol lookup
    reaches the libmpi it links)."""
    from mpi4py import MPI

    family = library_family(MPI.Get_library_version())
    queries: dict[str, int] = {}
    try:
        lib = ctypes.CDLL(MPI.__file__)
    except OSError:
        lib = None
    if lib is not None:
        for name in sorted({n for names in QUERIES.values() for n in names}):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                queries[name] = int(fn())
        fn = getattr(lib, "MPIX_GPU_query_support", None)
        if fn is not None:
            for vendor, type_id in MPICH_GPU_TYPE.items():
                ok = ctypes.c_int(0)
                if fn(ctypes.c_int(type_id), ctypes.byref(ok)) == 0:
                    queries[f"MPIX_GPU_query_support({type_id})"] = int(ok.value)
    return LibraryFacts(family, queries, _loaded_gtl())


def _loaded_gtl() -> tuple:
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return ()
    return tuple(sorted(lib for lib in CRAY_GTL.values() if lib in maps))


def detect_gpu_aware(setting: str, vendor: str | None, facts: LibraryFacts | None = None,
                     env=None) -> GPUAwareness:
    """The answer for device memory of ``vendor`` (``cuda``, ``hip``, ``ze``; None:
    host memory). ``facts`` default to the loaded library's."""
    if setting not in SETTINGS:
        raise ValueError(f"gpu_aware must be one of {', '.join(SETTINGS)}, not {setting!r}")
    if vendor is None:
        return HOST_MEMORY
    env = os.environ if env is None else env
    facts = read_library_facts() if facts is None else facts
    reductions = facts.family != "open-mpi"
    if setting != "auto":
        return GPUAwareness(setting == "yes", f"--comm.gpu_aware={setting}", reductions)
    found = _ask(vendor, facts, env)
    return GPUAwareness(found[0], found[1], reductions) if found[0] else \
        GPUAwareness(False, found[1])


def _ask(vendor: str, facts: LibraryFacts, env) -> tuple[bool, str]:
    what = VENDOR_NAMES[vendor]
    if facts.family == "cray-mpich":
        gtl = CRAY_GTL[vendor]
        enabled = env.get("MPICH_GPU_SUPPORT_ENABLED", "") == "1"
        if gtl in facts.gtl and enabled:
            return True, f"Cray MPICH with {gtl} loaded and MPICH_GPU_SUPPORT_ENABLED=1"
        missing = [x for x, ok in ((f"{gtl} is not loaded", gtl in facts.gtl),
                                   ("MPICH_GPU_SUPPORT_ENABLED is not 1", enabled)) if not ok]
        return False, f"Cray MPICH: {' and '.join(missing)}"
    for name in QUERIES[vendor]:
        if name in facts.queries:
            return bool(facts.queries[name]), f"{name}() == {facts.queries[name]}"
    key = f"MPIX_GPU_query_support({MPICH_GPU_TYPE[vendor]})"
    if key in facts.queries:
        return bool(facts.queries[key]), f"{key} says {facts.queries[key]} ({what})"
    if facts.family == "mvapich" and env.get("MV2_USE_CUDA") == "1" and vendor == "cuda":
        return True, "MVAPICH with MV2_USE_CUDA=1"
    return False, f"this {facts.family} library offers no {what} support query"
