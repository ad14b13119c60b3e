"""The fake accelerator (``--train.device=fake``): the CPU posing as a GPU, so that the
accelerator branches of the device layer, the buffers and the engines run in tests on
machines without one. docs/design/devices.md says what it proves and what it cannot.
"""

from __future__ import annotations

import threading
import weakref

import torch

from hpctrain.comm.device import Accelerator, Event
from hpctrain.comm.phase_clock import HostMark

# DLPack device types (dlpack.h): what mpi4py is told a buffer's memory is.
DLPACK_CUDA = 2
_PRUNE_AT = 4096  # watched storages before the dead references are dropped


class _FakeEvent(Event):
    """An event on the fake device's one in-order stream. The device lags the host: an
    event has not passed at its first query (so the code's deferral paths run), has at
    the second; waiting for one (or seeing it pass) passes every event recorded before
    it, as on a real stream."""

    def record(self):
        self.seq, self.asked = self.accel.next_seq(), False
        return super().record()

    def _passed(self) -> bool:
        if self.seq <= self.accel.done_seq or self.asked:
            self._block()
            return True
        self.asked = True
        return False

    def _block(self) -> None:
        self.accel.done_seq = max(self.accel.done_seq, self.seq)


class _FakeMark(HostMark):
    """The phase clock's event on the fake stream: the host's time when it was recorded,
    readable only once the host has waited for it or a later one (as a GPU's timing
    event, whose time exists only once the device has passed it): a clock that read a
    step's spans before its one wait, or never waited, raises."""

    def __init__(self, accel: FakeAccelerator):
        super().__init__()
        self.accel, self.seq = accel, accel.next_seq()

    def wait(self):
        self.accel.done_seq = max(self.accel.done_seq, self.seq)

    def passed(self) -> bool:
        return self.seq <= self.accel.done_seq

    def seconds_to(self, later):
        if max(self.seq, later.seq) > self.accel.done_seq:
            raise RuntimeError("a fake timing event read before the host waited for it")
        return super().seconds_to(later)


class _StorageSet:
    """Tensors, held weakly, found by their storage: ``t in s`` when a tensor still alive
    in the set shares ``t``'s storage (a view of device memory is device memory). Looked
    up by the storage's address, since every ``.numpy()`` and ``.cpu()`` of the process
    asks."""

    def __init__(self):
        self._refs: dict[int, list[weakref.ref]] = {}

    def add(self, t: torch.Tensor) -> None:
        if len(self._refs) >= _PRUNE_AT:
            self._refs = {k: alive for k, refs in self._refs.items()
                          if (alive := [r for r in refs if r() is not None])}
        self._refs.setdefault(t.untyped_storage()._cdata, []).append(weakref.ref(t))

    def __contains__(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()._cdata
        # A freed storage's address can be reused: only a live member with it counts.
        return any((u := r()) is not None and u.untyped_storage()._cdata == storage
                   for r in self._refs.get(storage, ()))


class _FakeDeviceMemory:
    """A CPU tensor as mpi4py sees device memory: through DLPack, labelled CUDA (so
    mpi4py refuses to treat it as host memory and asks for ``stream=-1``, promising to
    synchronize itself). The data pointer is the CPU tensor's, which the MPI library can
    read as it would read a GPU-aware device pointer."""

    def __init__(self, accel: FakeAccelerator, t: torch.Tensor, ready: Event | None):
        self.accel, self.t, self.ready = accel, t, ready

    def __dlpack_device__(self):
        return (DLPACK_CUDA, self.accel.index or 0)

    def __dlpack__(self, *, stream=None, max_version=None, copy=None, **_):
        if self.ready is None or not self.ready.done:
            self.accel.stats.unready_handoffs += 1
        return self.t.__dlpack__(max_version=max_version) if max_version else \
            self.t.__dlpack__()


class FakeAccelerator(Accelerator):
    """The CPU posing as a GPU, for tests of the accelerator branches without one.

    - Tensors live on the CPU but count as device memory: the buffer layer hands them to
      MPI through DLPack labelled as CUDA memory, or stages them through host buffers
      (``host_empty``) when MPI is not GPU-aware, exactly as on a GPU.
    - Events are counted; one has not passed at its first query, so deferred launches run.
    - ``backward`` runs on a thread of its own, as CUDA's autograd runs gradient hooks on
      a per-device worker thread: MPI is called from there.
    - ``.numpy()`` of device memory raises (as on a GPU) and is counted; ``.cpu()`` of
      device memory copies (as on a GPU, so code that copies first passes).
    """

    kind = "fake"
    vendor = "cuda"  # what MPI's GPU support is asked about
    is_accelerator = True
    hooks_off_main_thread = True

    def __init__(self, index: int = 0, *, placement: str = ""):
        super().__init__(index, placement=placement)
        self._device = _StorageSet()  # device tensors handed to MPI
        self._host = _StorageSet()  # staging buffers
        self._seq = self.done_seq = 0  # events recorded / passed on the one stream
        _watch_numpy(self)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    @property
    def torch_device(self):
        return torch.device("cpu")

    @property
    def name(self):
        return "fake accelerator (CPU)"

    def describe(self):
        return f"fake:{self.index} (CPU posing as a GPU)"

    def identity(self):
        return f"fake:{self.index}"

    def host_empty(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self._host.add(t)
        return t

    def holds(self, x):
        return isinstance(x, torch.Tensor) and x.device.type == "cpu" and \
            x not in self._host

    def to_device(self, t):
        return t.clone()  # a copy, as a host-to-device transfer is

    def for_mpi(self, t, ready=None):
        return _FakeDeviceMemory(self, t, ready)

    def track(self, t):
        self._device.add(t)

    def is_device_memory(self, t: torch.Tensor) -> bool:
        return t in self._device

    def event(self):
        return _FakeEvent(self)

    def mark(self):
        return _FakeMark(self)

    def _synchronize(self):
        self.done_seq = self._seq

    def _run_autograd(self, passes):
        failure: list[BaseException] = []

        def run():
            try:
                passes()
            except BaseException as e:  # re-raised on the caller's thread
                failure.append(e)

        worker = threading.Thread(target=run, name="fake-autograd")
        worker.start()
        worker.join()
        if failure:
            raise failure[0]

    def close(self):
        _FAKES.discard(self)


# The fake devices alive in this process, watched by the patched Tensor.numpy / .cpu.
_FAKES: weakref.WeakSet = weakref.WeakSet()
_ORIGINAL: dict = {}


def _watch_numpy(accel: FakeAccelerator) -> None:
    _FAKES.add(accel)
    if _ORIGINAL:
        return
    _ORIGINAL.update(numpy=torch.Tensor.numpy, cpu=torch.Tensor.cpu)

    def owner(t):
        return next((a for a in list(_FAKES) if a.is_device_memory(t)), None)

    def numpy(self, *args, **kwargs):
        accel = owner(self) if _FAKES else None
        if accel is not None:
            accel.stats.numpy_on_device += 1
            raise TypeError("can't convert fake device memory to numpy (a GPU tensor would "
                            "refuse too): copy it to the host first (.cpu())")
        return _ORIGINAL["numpy"](self, *args, **kwargs)

    def cpu(self, *args, **kwargs):
        out = _ORIGINAL["cpu"](self, *args, **kwargs)
        if out is self and _FAKES and owner(self) is not None:
            return out.clone()  # a device-to-host copy on a real device
        return out

    torch.Tensor.numpy = numpy
    torch.Tensor.cpu = cpu
