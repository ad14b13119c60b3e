"""Buckets of gradients and the order their reductions start in; shared by data
parallelism (``data_parallel.py``) and ZeRO (``zero/``).

MPI requires every rank to start collectives on a communicator in the same order, but
autograd may finish a later bucket's gradients before an earlier one's. So a bucket is
launched only when it *and every bucket before it* are complete (as PyTorch DDP does).
Each gradient hook also polls the reductions in flight: MPICH progresses nonblocking
collectives only inside MPI calls, so polling during backward is what overlaps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.comm.mpi import MPI
from hpctrain.comm.phase_clock import PhaseClock
from hpctrain.comm.watchdog import wait_all


def plan_buckets(numels: list[int], elem_bytes: int, cap_bytes: int,
                 first_cap_bytes: int) -> list[list[int]]:
    """Split a sequence of tensors (given in reduction order) into buckets.

    A bucket is closed before it would exceed its cap; a tensor larger than the cap gets
    a bucket of its own. Returns lists of indices into ``numels``.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, first_cap_bytes
    for i, n in enumerate(numels):
        nbytes = n * elem_bytes
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size, cap = [], 0, cap_bytes
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def split_by_kind(buckets: list[list[int]], kinds: list[bool]) -> list[list[int]]:
    """``buckets`` cut where ``kinds[i]`` changes, so that no bucket mixes the two kinds
    (expert parallelism: experts are reduced over another group than the rest)."""
    out: list[list[int]] = []
    for bucket in buckets:
        run = [bucket[0]]
        for i in bucket[1:]:
            if kinds[i] != kinds[run[-1]]:
                out.append(run)
                run = []
            run.append(i)
        out.append(run)
    return out


@dataclass
class CommStats:
    reductions: int = 0
    """Bucket reductions launched since construction."""
    bytes_reduced: int = 0
    gathers: int = 0
    """Parameter allgathers (ZeRO)."""
    wait_s: float = 0.0
    """Time spent in ``finish()`` waiting for reductions: communication not hidden (on one
    node with shared memory, also the sums themselves)."""
    launched_in_backward: int = 0
    """Reductions started from a gradient hook, while backward still ran (the rest start
    in ``finish()``): how much communication had the chance to overlap compute."""
    hook_s: float = 0.0
    """Time gradient hooks spent launching and polling reductions during backward (with
    the shared-memory allreduce across nodes, also its summing): the reductions' cost on
    the critical path while they overlap."""


class BucketScheduler:
    """Starts one reduction per bucket, in bucket order, as the buckets fill.

    Buckets need ``params`` and a ``pending`` count. Subclasses implement ``launch``
    (start the bucket's reduction, return its request) and ``complete`` (after it is
    done), and call ``grad_ready`` from their gradient hooks. On a GPU a bucket whose
    gradients are all queued is not yet written: ``bucket_ready`` (when its last gradient
    arrives) lets the engine queue what the device must do and record an event, and the
    bucket is launched once ``can_launch`` says the event has passed, at a later hook or
    in ``finish()`` (which waits for it): the host never stalls the device mid-backward.
    """

    def __init__(self, buckets: list, *, timeout: float, clock: PhaseClock):
        """``clock``: the rank's phase clock (``accel.clock``), which times the hooks
        and the wait in ``finish()``."""
        self.sched_buckets = buckets
        self.clock = clock
        self.timeout = timeout
        self.stats = CommStats()
        self.syncing = True
        self._next = 0
        self._inflight: list[tuple[object, MPI.Request]] = []

    def launch(self, bucket) -> MPI.Request:
        raise NotImplementedError

    def complete(self, bucket) -> None:
        raise NotImplementedError

    def bucket_ready(self, bucket) -> None:
        """Every gradient of ``bucket`` is queued (or none will come): prepare its
        buffer for MPI (device work, an event). Nothing by default."""

    def can_launch(self, bucket) -> bool:
        """Whether the device is done with ``bucket``'s buffer (never blocks)."""
        return True

    def prepare_for_backward(self, sync: bool) -> None:
        """Call before each backward; ``sync=False`` accumulates locally (no communication)."""
        self.syncing = sync
        if sync:
            for b in self.sched_buckets:
                b.pending = len(b.params)
            self._next = 0
            self._inflight = []

    def grad_ready(self, bucket) -> None:
        """One more of ``bucket``'s gradients is final for this backward."""
        if not self.syncing:
            return
        bucket.pending -= 1
        buckets = self.sched_buckets
        next_complete = self._next < len(buckets) and buckets[self._next].pending <= 0
        if bucket.pending > 0 and not next_complete and not self._inflight:
            return  # nothing to launch or poll: no span (on a GPU, two events saved)
        with self.clock.span("hooks") as hook:
            if bucket.pending == 0:
                self.bucket_ready(bucket)
            launched = self._launch_in_order(block=False)
            self.stats.launched_in_backward += launched
            if not launched and self._inflight:
                self.poll()
        self.stats.hook_s += hook.host_s

    def _launch_in_order(self, block: bool) -> int:
        """Launch the complete buckets in order; stop at one still waited for, or (not
        ``block``) whose device work has not finished. Returns how many were launched."""
        buckets, launched = self.sched_buckets, 0
        while self._next < len(buckets) and buckets[self._next].pending <= 0:
            b = buckets[self._next]
            if not block and not self.can_launch(b):
                break
            self._inflight.append((b, self.launch(b)))
            self._next += 1
            launched += 1
        return launched

    def poll(self) -> None:
        """Complete the reductions that are done, oldest first; stop at the first that is
        not (``MPI_Test`` one request at a time: MPICH 5.0's ``MPI_Testall`` errs on an
        active persistent collective)."""
        while self._inflight and self._inflight[0][1].Test():
            self.complete(self._inflight.pop(0)[0])

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def complete_oldest(self) -> None:
        """Wait for the oldest reduction in flight and complete it."""
        b, req = self._inflight.pop(0)
        wait_all([req], timeout=self.timeout, what=f"gradient reduction (bucket {b.index})")
        self.complete(b)

    def finish(self) -> None:
        """Launch what is left (parameters that got no gradient) and wait for everything."""
        if not self.syncing:
            return
        for b in self.sched_buckets[self._next:]:
            if b.pending > 0:  # some parameters got no gradient
                b.pending = 0
                self.bucket_ready(b)
        self._launch_in_order(block=True)
        with self.clock.span("wait") as wait:
            wait_all([req for _, req in self._inflight], timeout=self.timeout,
                     what=f"gradient reduction of {len(self.sched_buckets)} bucket(s)")
        self.stats.wait_s += wait.host_s
        for b, _ in self._inflight:
            self.complete(b)
        self._inflight = []
