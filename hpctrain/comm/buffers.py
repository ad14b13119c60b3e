"""Turn numpy arrays, torch tensors (CPU or CUDA) and cupy arrays into MPI buffers.

A CUDA buffer goes to MPI directly only when the MPI library is CUDA-aware; otherwise it
is staged through a pinned host buffer. mpi4py does not synchronize CUDA streams, so the
producing stream is always synchronized before MPI touches the memory.

Use ``MPIBuffer`` around a tensor that is communicated repeatedly (a gradient bucket): it
keeps its staging buffer, so a step allocates nothing.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

# Environment switches that MPI libraries document for GPU-aware transfers.
_ENV_SIGNALS = (
    ("MPICH_GPU_SUPPORT_ENABLED", "1"),  # HPE Cray MPICH (Polaris, Perlmutter, Frontier)
    ("MV2_USE_CUDA", "1"),  # MVAPICH2-GDR
    ("OMPI_MCA_opal_cuda_support", "true"),  # Open MPI built with CUDA
)


@dataclass(frozen=True)
class CudaAwareness:
    enabled: bool
    reason: str

    def __bool__(self) -> bool:
        return self.enabled

    def __str__(self) -> str:
        return f"{'yes' if self.enabled else 'no'} ({self.reason})"


def detect_cuda_aware(setting: str = "auto", env: dict | None = None) -> CudaAwareness:
    """Decide whether CUDA device pointers may be handed to MPI.

    ``setting`` is ``yes``/``no`` to force, or ``auto``: the ``HPCTRAIN_CUDA_AWARE``
    environment variable, then the documented switches of Cray MPICH, MVAPICH2 and Open
    MPI, then a query of the loaded library (``MPIX_Query_cuda_support`` in Open MPI,
    ``MPIX_GPU_query_support`` in MPICH 4). Anything uncertain answers no: a device
    pointer given to an MPI that is not CUDA-aware crashes, staging only costs copies.
    """
    env = os.environ if env is None else env
    setting = env.get("HPCTRAIN_CUDA_AWARE", setting).lower()
    if setting in ("1", "yes", "true"):
        return CudaAwareness(True, "forced on")
    if setting in ("0", "no", "false"):
        return CudaAwareness(False, "forced off")
    if setting != "auto":
        raise ValueError(f"cuda_aware must be auto, yes or no, not {setting!r}")
    for name, value in _ENV_SIGNALS:
        if env.get(name, "").lower() == value:
            return CudaAwareness(True, f"{name}={value}")
    found = _query_library()
    if found is not None:
        return found
    return CudaAwareness(False, "no CUDA-aware MPI detected; staging through host memory")


def _query_library() -> CudaAwareness | None:
    try:
        from mpi4py import MPI

        lib = ctypes.CDLL(MPI.__file__)
    except (ImportError, OSError):
        return None
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        if query() == 1:
            return CudaAwareness(True, "MPIX_Query_cuda_support() == 1")
        return CudaAwareness(False, "MPIX_Query_cuda_support() == 0")
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        supported = ctypes.c_int(0)
        cuda_kind = 1  # MPIX_GPU_SUPPORT_CUDA in mpi_proto.h
        if query(ctypes.c_int(cuda_kind), ctypes.byref(supported)) == 0 and supported.value:
            return CudaAwareness(True, "MPIX_GPU_query_support(CUDA) == 1")
    return None


# numpy has no bfloat16: such tensors travel as their 16-bit pattern (copies, p2p,
# broadcasts); reductions of bf16 are done in fp32 buffers by the callers.
_REINTERPRET = {"torch.bfloat16": "int16"}


# MPI datatypes for tensors handed over by address (``raw``); 16-bit floats travel as
# their bit patterns, which suits copies and gathers (never reductions).
_RAW_TYPES = {"torch.float32": "FLOAT", "torch.float64": "DOUBLE", "torch.int64": "INT64_T",
              "torch.int32": "INT32_T", "torch.bfloat16": "INT16_T", "torch.float16": "INT16_T"}


def _kind(x) -> str:
    mod = type(x).__module__
    if isinstance(x, np.ndarray):
        return "numpy"
    if mod.startswith("torch"):
        return "torch_cuda" if x.is_cuda else "torch_cpu"
    if mod.startswith("cupy"):
        return "cupy"
    raise TypeError(f"cannot communicate a {type(x).__name__}; use numpy, torch or cupy")


def _torch_cpu_view(t):
    if not t.is_contiguous():
        raise ValueError("MPI buffers must be contiguous tensors")
    alias = _REINTERPRET.get(str(t.dtype))
    if alias is not None:
        import torch

        t = t.view(getattr(torch, alias))
    return t.detach().numpy()


class MPIBuffer:
    """A tensor or array as MPI sees it, with host staging when needed.

    Call ``to_mpi()`` before handing ``obj`` to an MPI call (syncs the CUDA stream, or
    copies device to host) and ``from_mpi()`` after MPI wrote into it (copies host to
    device when staged). Both are no-ops for host memory.
    """

    def __init__(self, x, *, cuda_aware: bool | CudaAwareness = False, raw: bool = False):
        self.source = x
        self.kind = _kind(x)
        self.staged = self.kind in ("torch_cuda", "cupy") and not bool(cuda_aware)
        self._host = None
        # raw: hand MPI the tensor's current address as bytes, read at every to_mpi().
        # For storage that is freed and re-allocated (ZeRO-3 gathered parameters): a
        # numpy view would pin the storage (torch forbids resizing it) and go stale.
        self.raw = raw and self.kind.startswith("torch") and not self.staged
        if self.raw:
            self.obj = None
        elif self.kind == "numpy":
            self.obj = x
        elif self.kind == "torch_cpu":
            self.obj = _torch_cpu_view(x)
        elif not self.staged:
            self.obj = x  # mpi4py reads __cuda_array_interface__ / DLPack
        elif self.kind == "torch_cuda":
            import torch

            self._host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.obj = _torch_cpu_view(self._host)
        else:
            import cupyx

            self._host = cupyx.empty_pinned(x.shape, dtype=x.dtype)
            self.obj = self._host

    @property
    def staging_nbytes(self) -> int:
        """Bytes of the pinned host copy (0 when MPI reads the memory directly)."""
        return 0 if self._host is None else int(self._host.nbytes)

    def to_mpi(self) -> object:
        if self.raw:
            if self.kind == "torch_cuda":
                import torch

                torch.cuda.current_stream(self.source.device).synchronize()
            from mpi4py import MPI

            nbytes = self.source.numel() * self.source.element_size()
            datatype = _RAW_TYPES.get(str(self.source.dtype), MPI.BYTE)
            return [MPI.buffer.fromaddress(self.source.data_ptr(), nbytes),
                    getattr(MPI, datatype) if isinstance(datatype, str) else datatype]
        if self.kind == "torch_cuda":
            import torch

            if self.staged:
                self._host.copy_(self.source, non_blocking=True)
            torch.cuda.current_stream(self.source.device).synchronize()
        elif self.kind == "cupy":
            import cupy

            if self.staged:
                self.source.get(out=self._host, stream=cupy.cuda.get_current_stream())
            cupy.cuda.get_current_stream().synchronize()
        return self.obj

    def from_mpi(self) -> None:
        if not self.staged:
            return
        if self.kind == "torch_cuda":
            self.source.copy_(self._host, non_blocking=True)
        else:
            self.source.set(self._host)
