"""Tensors (host or device) and numpy arrays as MPI buffers.

Host memory goes to MPI as a numpy view (no copy). Device memory goes to MPI directly
through DLPack when the library is GPU-aware for this device's vendor (``gpu_aware.py``),
else through a host staging buffer the ``MPIBuffer`` keeps, so a step allocates nothing;
Open MPI's reductions are always staged (``reduction=True``). mpi4py synchronizes no
stream, so ``prepare()`` records an event behind the buffer's writes, ``ready()`` asks
whether it has passed without blocking, ``to_mpi()`` waits for that event only, and
``complete()`` copies a staged result back, queued on the stream.
Why events and staging: docs/design/devices.md ("Device memory to MPI").
"""

from __future__ import annotations

import numpy as np
import torch

from hpctrain.comm.device import Accelerator, Event
from hpctrain.comm.gpu_aware import HOST_MEMORY, GPUAwareness

# numpy has no bfloat16: host tensors of it travel as their 16-bit pattern (copies, p2p,
# broadcasts); reductions of bf16 are done in fp32 buffers by the callers. (Through
# DLPack a bf16 tensor is bytes to mpi4py: the same bits.)
_REINTERPRET = {torch.bfloat16: torch.int16}

# MPI datatypes for host tensors handed over by address (``raw``); 16-bit floats travel
# as their bit patterns, which suits copies and gathers (never reductions).
_RAW_TYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int64: "INT64_T",
              torch.int32: "INT32_T", torch.bfloat16: "INT16_T", torch.float16: "INT16_T"}

_HOST = Accelerator()


def host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a contiguous *host* tensor (bf16 as int16)."""
    if not t.is_contiguous():
        raise ValueError("MPI buffers must be contiguous tensors")
    alias = _REINTERPRET.get(t.dtype)
    return (t.view(alias) if alias is not None else t).detach().numpy()


class MPIBuffer:
    """``x`` (a numpy array or a tensor) as MPI sees it.

    ``accel`` and ``aware``: the rank's device and whether its MPI is GPU-aware (default:
    host memory). ``reduction``: the buffer takes part in nonblocking or persistent
    reductions (staged where the library cannot reduce device memory). ``raw``: hand MPI
    the host tensor's current address at every ``to_mpi()``, for storage that is freed
    and re-allocated (ZeRO-3 gathered parameters): a numpy view would pin the storage
    (torch forbids resizing it) and go stale.
    """

    def __init__(self, x, accel: Accelerator | None = None,
                 aware: GPUAwareness = HOST_MEMORY, *, reduction: bool = False,
                 raw: bool = False):
        if not isinstance(x, (np.ndarray, torch.Tensor)):
            raise TypeError(f"cannot communicate a {type(x).__name__}; use a numpy array "
                            "or a torch tensor")
        if isinstance(x, torch.Tensor) and not x.is_contiguous():
            raise ValueError("MPI buffers must be contiguous tensors")
        self.source = x
        self.accel = accel or _HOST
        self.on_device = isinstance(x, torch.Tensor) and self.accel.holds(x)
        self.staged = self.on_device and not (aware.direct and (aware.reductions
                                                                or not reduction))
        self.raw = raw and isinstance(x, torch.Tensor) and not self.on_device
        self._ready: Event | None = None
        """The event MPI waits for before it may use the buffer."""
        self._prepared = False
        self._host: torch.Tensor | None = None
        if self.on_device:
            self.accel.track(x)
            self._event = self.accel.event()
        if self.raw:
            self.obj = None
        elif isinstance(x, np.ndarray):
            self.obj = x
        elif not self.on_device:
            self.obj = host_view(x)
        elif self.staged:
            self._host = self.accel.host_empty(x.shape, x.dtype)
            self.obj = host_view(self._host)
        else:
            self.obj = None  # to_mpi() wraps the tensor for mpi4py each time

    @property
    def prepared(self) -> bool:
        """Whether ``prepare()`` ran since the buffer was last handed to MPI."""
        return self._prepared

    @property
    def staging_nbytes(self) -> int:
        """Bytes of the host staging copy (0 when MPI reads the memory directly)."""
        return 0 if self._host is None else self._host.numel() * self._host.element_size()

    def prepare(self, send: bool = True) -> None:
        """Queue what the device must do before MPI may use the buffer and record an
        event behind it. ``send=False``: MPI only writes the buffer (a receive): nothing
        is copied to the staging buffer, only the copy back from its last use must pass."""
        self._prepared = True
        if not self.on_device or (self.staged and not send):
            return
        if self.staged:  # on the copy stream: the event is the copy's
            self._ready = self.accel.staging_copy(self._host, self.source)
            self.accel.stats.staged_bytes += self.staging_nbytes
            return
        self._ready = self._event.record()

    @property
    def event_serial(self) -> int:
        """When the event MPI waits for was recorded (0: none to wait for)."""
        return self._ready.serial if self._ready is not None and not self._ready.done else 0

    def ready(self) -> bool:
        """Whether MPI may take the buffer now (its event has passed); never blocks."""
        return self._ready is None or self._ready.query()

    def to_mpi(self, send: bool = True):
        """What to hand to mpi4py, once the device is done with the buffer: waits for the
        event of ``prepare()`` (which runs here if it was not called since the last
        ``to_mpi``), never for the whole device."""
        if self.raw:
            from mpi4py import MPI

            t = self.source
            datatype = _RAW_TYPES.get(t.dtype)
            return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()),
                    getattr(MPI, datatype) if datatype else MPI.BYTE]
        if not self.on_device:
            return self.obj
        if not self._prepared:
            self.prepare(send)
        self._prepared = False
        if self._ready is not None:
            self._ready.wait()
        self.accel.note_handoff(not self.staged, self._ready)
        return self.obj if self.staged else self.accel.for_mpi(self.source, self._ready)

    def complete(self) -> None:
        """After MPI wrote a staged buffer: queue the copy back to the device (the host
        buffer stays busy until its event passes)."""
        if not self.staged:
            return
        self._ready = self.accel.staging_copy(self.source, self._host)
        self.accel.copy_done(self._ready)  # the compute stream reads it after the copy
        self.accel.stats.staged_bytes += self.staging_nbytes


def to_mpi_all(buffers: list[MPIBuffer], send: bool = True) -> list:
    """``to_mpi()`` of several buffers, in order of ``buffers``; those not prepared yet are
    prepared (``send``). The newest event is waited for first: a stream runs its work in
    order, so when it has passed the others have too and one wait covers them all."""
    for b in buffers:
        if not b.prepared:
            b.prepare(send)
    objs: dict[int, object] = {}
    for i in sorted(range(len(buffers)), key=lambda i: -buffers[i].event_serial):
        objs[i] = buffers[i].to_mpi(send)
    return [objs[i] for i in range(len(buffers))]


def persistent_allreduce_works(comm, accel: Accelerator, aware: GPUAwareness,
                               timeout: float) -> bool:
    """Whether a persistent allreduce (``Allreduce_init``) works on device memory of
    ``accel`` handed over directly, tried with one element on every rank, the answer
    agreed (MPICH builds the schedule on the host; other libraries may refuse device
    memory there). Collective over ``comm``."""
    from mpi4py import MPI

    from hpctrain.comm.small_collectives import allreduce_array
    from hpctrain.comm.watchdog import wait_all

    def agree(ok: bool) -> bool:
        return bool(allreduce_array(comm, [int(ok)], timeout=timeout, op=MPI.MIN,
                                    what="agreeing on persistent device reductions")[0])

    buf = MPIBuffer(torch.ones(1, device=accel.torch_device), accel, aware, reduction=True)
    try:
        req = comm.Allreduce_init(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)
    except (AttributeError, NotImplementedError, MPI.Exception):
        req = None
    if not agree(req is not None):
        if req is not None:
            req.Free()
        return False
    try:
        buf.to_mpi()
        req.Start()
        wait_all([req], timeout=timeout, what="persistent allreduce probe on device memory")
        buf.complete()
        ok = float(buf.source.cpu()[0]) == comm.Get_size()
    finally:
        req.Free()
    return agree(ok)
