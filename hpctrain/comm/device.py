"""One device layer: what a rank's device is, how the host waits for it, host buffers for
staging, memory figures. Which device a rank takes: ``placement.py``; the fake one:
``fake_device.py``; profiler ranges: ``hpctrain/profiling.py``; peak FLOP rates:
``hpctrain/systems/devices.toml``.

Kinds (``--train.device``): ``cpu``, ``cuda`` (NVIDIA, and AMD under ROCm), ``xpu``
(Intel, Level Zero) and ``fake`` (the CPU taking every accelerator branch). mpi4py hands
MPI a device pointer without synchronizing, so the host records an ``Event`` when a
buffer is ready and starts the MPI call once it has passed, never synchronizing the
device; every kind counts its events and waits in ``stats``.
Why events, and the kinds: docs/design/devices.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from hpctrain.comm.phase_clock import DEVICE_EVENTS, HOST, DeviceMark, HostMark, PhaseClock
from hpctrain.sizes import GiB


@dataclass
class DeviceStats:
    """What the host did to wait for the device (and what went through host memory)."""
    event_records: int = 0
    event_queries: int = 0
    """Non-blocking checks whether an event has passed."""
    event_waits: int = 0
    """Blocking waits on an event that had not yet passed."""
    device_syncs: int = 0
    """Whole-device synchronizations (none of hpctrain's step code makes one)."""
    syncs_in_backward: int = 0
    """Whole-device synchronizations made during a backward pass."""
    staged_bytes: int = 0
    """Bytes copied between device memory and host staging buffers for MPI."""
    staging_copies: int = 0
    """Staging copies queued on the device's copy stream (beside the compute stream)."""
    pinned_batches_reused: int = 0
    """Batches copied to the device from a page-locked buffer made at an earlier step."""
    direct_handoffs: int = 0
    """Device buffers handed to MPI as device memory (GPU-aware MPI), or to the device
    collective library (``--comm.transport=xccl``)."""
    handoffs_off_main_thread: int = 0
    """Buffers made ready for MPI on a thread other than the main one (autograd's)."""
    unready_handoffs: int = 0
    """Buffers handed to MPI or to a host-ordered device library (gloo) before the event
    of their last device work had passed (the fake device also counts those whose DLPack
    capsule mpi4py took too early)."""
    numpy_on_device: int = 0
    """Fake device: ``.numpy()`` asked of device memory (a real GPU raises)."""

    def snapshot(self) -> dict:
        return dict(self.__dict__)


class Event:
    """A point in the current stream's queue of work. ``record()`` marks it, ``query()``
    says (without blocking) whether the device has passed it, ``wait()`` blocks the host
    until it has (counted only when it had not). A host event has always passed."""

    def __init__(self, accel: Accelerator, raw=None):
        self.accel, self.raw = accel, raw
        self.done = True
        self.serial = 0

    def record(self) -> Event:
        if self.raw is not None:
            self.raw.record()
        self.accel.stats.event_records += 1
        self.serial = self.accel.stats.event_records  # later records pass later
        self.done = False
        return self

    def query(self) -> bool:
        if not self.done:
            self.accel.stats.event_queries += 1
            self.done = self._passed()
        return self.done

    def wait(self) -> None:
        if self.done or self._passed():
            self.done = True
            return
        self.accel.stats.event_waits += 1
        self._block()
        self.done = True

    def _passed(self) -> bool:
        return self.raw is None or self.raw.query()

    def _block(self) -> None:
        self.raw.synchronize()


class Accelerator:
    """The host (``cpu``) and the base of the device kinds. ``torch_device`` is where this
    rank's tensors live; ``vendor`` is what MPI's GPU support is asked about (``cuda``,
    ``hip``, ``ze``; None for host memory)."""

    kind = "cpu"
    vendor: str | None = None
    is_accelerator = False
    hooks_off_main_thread = False
    """Whether autograd runs gradient hooks (which call MPI) on a thread of its own."""

    def __init__(self, index: int | None = None, *, placement: str = ""):
        self.index = index
        self.placement = placement
        """How the device was chosen among those visible (for the start-up line)."""
        self.stats = DeviceStats()
        self._backward_depth = 0
        self.clock = PhaseClock(self.mark, DEVICE_EVENTS if self.is_accelerator else HOST)
        """This rank's one timer of a step's phases (what the runner, the engines and the
        trainer bracket their work with)."""

    # ----------------------------------------------------------------- identity
    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind if self.index is None else f"{self.kind}:{self.index}")

    @property
    def name(self) -> str:
        """The runtime's name of the device (what the peak table is matched against)."""
        return "cpu"

    def describe(self) -> str:
        if not self.is_accelerator:
            return "cpu"
        where = f" ({self.placement})" if self.placement else ""
        return f"{self.torch_device} {self.name}{where}"

    def identity(self) -> str | None:
        """What tells this device apart from the others of its node: ranks that report
        the same identity compute on one device (and share its peak). None: the host,
        where each rank counts as a device of its own."""
        return None

    # ----------------------------------------------------------------- memory
    def holds(self, x) -> bool:
        """Whether ``x`` is this device's memory (MPI needs a device path for it)."""
        return False

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for staging device memory (page-locked on a GPU, so copies run
        asynchronously and at full speed)."""
        return torch.empty(shape, dtype=dtype)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor (a batch) on this device, copied without blocking the host."""
        return t

    def staging_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Event:
        """Queue ``dst.copy_(src)`` between device memory and a host staging buffer, after
        the work queued so far, without blocking the host; returns the event behind it.
        A GPU runs it on a copy stream of its own, so the copy overlaps compute;
        ``copy_done`` makes the compute stream wait for it (copies back to the device)."""
        dst.copy_(src, non_blocking=True)
        self.stats.staging_copies += 1
        return self.event().record()

    def copy_done(self, event: Event) -> None:
        """The compute stream waits (on the device, not the host) for ``event``."""

    def for_mpi(self, t: torch.Tensor, ready: Event | None = None):
        """What mpi4py is given for device tensor ``t`` once ``ready`` has passed: the
        tensor itself (mpi4py reads its DLPack capsule, whatever the device type)."""
        return t

    def track(self, t: torch.Tensor) -> None:
        """``t`` is device memory handed to MPI (the fake device watches it)."""

    def memory_stats(self) -> dict[str, int]:
        """Bytes allocated now, at peak, and reserved by the caching allocator ({} on the
        host: the engines' ``memory()`` reports count its tensors)."""
        return {}

    def describe_memory(self) -> str:
        """``memory_stats()`` for a log line ('' on the host)."""
        stats = self.memory_stats()
        if not stats:
            return ""
        gib = {k: v / GiB for k, v in stats.items()}
        return (f"device: {gib['allocated']:.2f} GiB allocated, {gib['peak']:.2f} GiB "
                f"peak, {gib['reserved']:.2f} GiB reserved")

    # ----------------------------------------------------------------- waiting
    def event(self) -> Event:
        return Event(self)

    def mark(self) -> HostMark:
        """A point on this device's timeline for the phase clock: the host's clock here
        (work runs as it is queued); a timing event on the current stream on a GPU."""
        return HostMark()

    def synchronize(self) -> None:
        """Wait for all work on the device (never inside a step; counted)."""
        self.stats.device_syncs += 1
        if self._backward_depth:
            self.stats.syncs_in_backward += 1
        self._synchronize()

    def _synchronize(self) -> None:
        pass

    def backward(self, tensor: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
        """``tensor.backward(gradient)``, marked as a backward pass (see ``stats``)."""
        self.autograd(lambda: tensor.backward(gradient))

    def autograd(self, passes) -> None:
        """Run ``passes()`` (autograd work: a backward or a part of one, as a pipeline's
        split B and W), marked as a backward pass."""
        self._backward_depth += 1
        try:
            self._run_autograd(passes)
        finally:
            self._backward_depth -= 1

    def _run_autograd(self, passes) -> None:
        passes()

    def note_handoff(self, direct: bool, ready: Event | None) -> None:
        """A buffer of this device goes to MPI or to the device library (``ready``: the
        event it had to pass)."""
        if direct:
            self.stats.direct_handoffs += 1
        if ready is not None and not ready.done:
            self.stats.unready_handoffs += 1
        if threading.current_thread() is not threading.main_thread():
            self.stats.handoffs_off_main_thread += 1

    def close(self) -> None:
        """Nothing to release (the fake device removes its watch on ``.numpy()``)."""


class GPUAccelerator(Accelerator):
    """``cuda`` (NVIDIA, or AMD under ROCm) and ``xpu`` (Intel Level Zero)."""

    is_accelerator = True
    hooks_off_main_thread = True  # autograd's per-device worker thread

    def __init__(self, kind: str, index: int, *, placement: str = ""):
        self.kind = kind
        self.module = getattr(torch, kind)
        if kind == "xpu":
            self.vendor = "ze"
        else:
            self.vendor = "hip" if torch.version.hip else "cuda"
        super().__init__(index, placement=placement)
        self._pinned: dict[tuple, list] = {}
        self._copy_stream = None

    @property
    def name(self) -> str:
        return self.module.get_device_name(self.index)

    def identity(self) -> str:
        """The device's UUID where the runtime has one (a rank that sees one GPU through
        its own visibility mask calls it device 0 whatever GPU it is), else its index."""
        uuid = getattr(self.module.get_device_properties(self.index), "uuid", None)
        return str(uuid) if uuid is not None else f"{self.kind}:{self.index}"

    def holds(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.device.type == self.kind

    def host_empty(self, shape, dtype):
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    PINNED_RING = 4
    """Page-locked buffers kept per batch shape: a buffer is refilled only once the copy
    from it that was queued ``PINNED_RING`` batches earlier has finished."""

    def to_device(self, t):
        key = (tuple(t.shape), t.dtype)
        ring = self._pinned.setdefault(key, [])
        if len(ring) < self.PINNED_RING:
            slot = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True), self.event())
            ring.append(slot)
        else:
            slot = ring.pop(0)
            ring.append(slot)
            self.stats.pinned_batches_reused += 1
        host, done = slot
        done.wait()  # the copy out of it, queued PINNED_RING batches ago
        host.copy_(t)
        out = host.to(self.torch_device, non_blocking=True)
        done.record()
        return out

    def staging_copy(self, dst, src):
        if self._copy_stream is None:
            self._copy_stream = self.module.Stream(self.index)
        queued = self.module.Event()
        queued.record()  # behind the work that writes src (current stream)
        self._copy_stream.wait_event(queued)
        with self.module.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            done = self.event().record()
        self.stats.staging_copies += 1
        return done

    def copy_done(self, event):
        self.module.current_stream(self.index).wait_event(event.raw)

    def memory_stats(self):
        m = self.module
        return {"allocated": m.memory_allocated(self.index),
                "peak": m.max_memory_allocated(self.index),
                "reserved": m.memory_reserved(self.index)}

    def event(self):
        return Event(self, self.module.Event())

    def mark(self):
        return DeviceMark(self.module)

    def _synchronize(self):
        self.module.synchronize(self.index)
