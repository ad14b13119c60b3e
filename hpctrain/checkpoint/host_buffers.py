"""Host memory an asynchronous checkpoint copies a rank's state into, kept from one save
to the next (``--train.ckpt_async``; docs/design/checkpoints.md, "Asynchronous saves").

The copy is what lets training go on: the writer thread writes the copy while the
optimizer changes the tensors. Tensors on a GPU go into pinned (page-locked) buffers,
copied without blocking the host; ``ready()`` waits for those copies, and the writer calls
it before it reads a byte. Buffers are reused while the shapes stay the same, so a run
pays for the memory once; a buffer is only written again after the previous save's
writer has finished with it (``train/saving.py`` waits for it first).
"""

from __future__ import annotations

import math

import numpy as np
import torch

HOST_SHARE = 0.8
"""The part of the node's available memory the ranks' copies may take together: the rest
is left to the page cache the writes go through, and to everything else on the node."""


def available_bytes() -> int | None:
    """The node's available memory (``MemAvailable`` of /proc/meminfo); None where it
    cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def copy_bytes(sources: dict[str, torch.Tensor]) -> int:
    """The bytes of host memory the copy of ``sources`` takes."""
    return sum(math.prod(t.shape) * _host_dtype(t).itemsize for t in sources.values())


def _host_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.is_floating_point() else t.dtype  # the shard stores fp32


class HostBuffers:
    """Reusable host copies of one rank's checkpoint datasets, by dataset name."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending: list = []  # events of copies from a device still under way

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def fits(self, sources: dict[str, torch.Tensor], local_ranks: int,
             available: int | None) -> bool:
        """Whether copying ``sources`` leaves the node enough memory: the new bytes
        (beyond what these buffers hold already) of each of ``local_ranks`` ranks, within
        ``HOST_SHARE`` of ``available`` (unknown: assumed to fit)."""
        new = copy_bytes(sources) - (self.nbytes if self._reusable(sources) else 0)
        return available is None or new * local_ranks <= HOST_SHARE * available

    def copy(self, sources: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Copy ``sources`` into the buffers (made or remade where a shape changed) and
        return numpy views of them, to be read only after ``ready()``."""
        if not self._reusable(sources):
            self._buffers = {k: torch.empty(tuple(t.shape), dtype=_host_dtype(t),
                                            pin_memory=t.device.type not in ("cpu", "meta"))
                             for k, t in sources.items()}
        devices = set()
        for k, t in sources.items():
            on_device = t.device.type != "cpu"
            self._buffers[k].copy_(t.detach(), non_blocking=on_device)
            if on_device:
                devices.add(t.device.type)
        self._pending = []
        for kind in devices:  # e.g. torch.cuda.Event: the copies queued so far
            event = getattr(torch, kind).Event()
            event.record()
            self._pending.append(event)
        return {k: b.numpy() for k, b in self._buffers.items()}

    def ready(self) -> None:
        """Wait until the copies from a device have landed (the writer thread calls it)."""
        for event in self._pending:
            event.synchronize()

    def _reusable(self, sources: dict[str, torch.Tensor]) -> bool:
        return (self._buffers.keys() == sources.keys()
                and all(b.shape == t.shape and b.dtype == _host_dtype(t)
                        for b, t in zip((self._buffers[k] for k in sources),
                                        sources.values())))
