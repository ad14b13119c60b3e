"""ZeRO-3's parameter gathers: a block's full parameters exist only while it computes.

Each rank keeps only its shard of every bucket's parameters. Module hooks allgather a
block's bucket before its forward and again in backward, free it after each use, and
start the next block's gather early (a prefetch), on a communicator of their own. A full
buffer is ``FREE``, ``IN_FLIGHT`` or ``HELD``; ``gathered()`` holds every bucket (to
save, evaluate or sample) and pins them until it exits.
When each bucket is gathered, and why: docs/design/zero.md ("ZeRO-3").
"""

from __future__ import annotations

import contextlib
import enum
import functools

import torch

from hpctrain.comm.transport import Request, Transport
from hpctrain.comm.watchdog import wait_all
from hpctrain.parallel.bucketing import CommStats
from hpctrain.parallel.memory import tensor_bytes
from hpctrain.parallel.zero.buckets import ZeroBucket, free_storage, refill_storage


class Residency(enum.Enum):
    FREE = "free"
    IN_FLIGHT = "in flight"
    HELD = "held"


class ParameterGather:
    """The gathers of one ZeRO-3 engine: which buckets hold their full parameters, the
    requests in flight, and the bytes held (``gathered_bytes``, ``peak_gathered_bytes``)."""

    def __init__(self, buckets: list[ZeroBucket], transport: Transport, timeout: float,
                 stats: CommStats):
        """``transport``: a channel of its own (the reductions' ``sibling()``)."""
        self.buckets, self.transport, self.timeout = buckets, transport, timeout
        self.stats = stats
        self.residency = {b.index: Residency.FREE for b in buckets}
        self.requests: dict[int, Request] = {}
        self.pinned = False
        self.gathered_bytes = self.peak_gathered_bytes = 0

    def install_hooks(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        """Gather around ``model``'s forward and each block's forward and backward.
        Buckets are in backward order: block i's is ``buckets[n - 1 - i]``, the last one
        holds everything outside the blocks."""
        n = len(blocks)
        by_block = {i: self.buckets[n - 1 - i] for i in range(n)}
        outer = self.buckets[-1]

        def root_pre(_module, _args):
            self.gather(outer, wait=True)
            self.gather(by_block[0], wait=False)  # prefetch

        def root_post(_module, _args, _output):
            if torch.is_grad_enabled():
                self.gather(by_block[n - 1], wait=False)  # backward starts with it
            else:
                self.release(outer)

        def block_pre(i, _module, _args):
            self.gather(by_block[i], wait=True)
            if i + 1 < n:
                self.gather(by_block[i + 1], wait=False)

        def block_backward(i):
            self.gather(by_block[i], wait=True)
            if i > 0:
                self.gather(by_block[i - 1], wait=False)

        def block_post(i, _module, _args, output):
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda grad: block_backward(i))
            self.release(by_block[i])

        model.register_forward_pre_hook(root_pre)
        model.register_forward_hook(root_post)
        for i, blk in enumerate(blocks):
            blk.register_forward_pre_hook(functools.partial(block_pre, i))
            blk.register_forward_hook(functools.partial(block_post, i))

    def gather(self, b: ZeroBucket, *, wait: bool) -> None:
        """Start ``b``'s allgather if its parameters are free; with ``wait``, also wait
        until they are held."""
        if self.residency[b.index] is Residency.FREE:
            refill_storage(b.full)
            self.gathered_bytes += tensor_bytes(b.full)
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
            b.shard_mpi.prepare()
            b.full_mpi().prepare(send=False)  # only written: nothing to stage
            self.requests[b.index] = self.transport.allgather(b.full_mpi(), b.shard_mpi)
            self.residency[b.index] = Residency.IN_FLIGHT
            self.stats.gathers += 1
        if wait and self.residency[b.index] is Residency.IN_FLIGHT:
            wait_all([self.requests.pop(b.index)], timeout=self.timeout,
                     what=f"ZeRO-3 parameter gather (bucket {b.index})")
            b.full_mpi().complete()
            self.residency[b.index] = Residency.HELD

    def release(self, b: ZeroBucket) -> None:
        """Free ``b``'s full parameters (unless pinned or already free)."""
        if self.pinned or self.residency[b.index] is Residency.FREE:
            return
        self.gather(b, wait=True)  # a prefetch still in flight must land first
        self.gathered_bytes -= tensor_bytes(b.full)
        free_storage(b.full)
        self.residency[b.index] = Residency.FREE

    def release_all(self) -> None:
        for b in self.buckets:
            self.release(b)

    @contextlib.contextmanager
    def all_held(self, model: torch.nn.Module):
        """Every bucket's parameters held and pinned until exit (collective)."""
        for b in self.buckets:
            self.gather(b, wait=True)
        self.pinned = True
        try:
            yield model
        finally:
            self.pinned = False
            self.release_all()
