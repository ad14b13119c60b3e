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
                 stats: CommStats, expert_transport: Transport | None = None):
        """``transport``: a channel of its own (the reductions' ``sibling()``);
        ``expert_transport``: the same over the ranks holding the same experts."""
        self.buckets, self.transport, self.timeout = buckets, transport, timeout
        self.expert_transport = expert_transport
        self.stats = stats
        self.residency = {b.index: Residency.FREE for b in buckets}
        self.requests: dict[int, Request] = {}
        self.pinned = False
        self.gathered_bytes = self.peak_gathered_bytes = 0

    def install_hooks(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        """Gather around ``model``'s forward and each block's forward and backward.
        A block's buckets are those holding its parameters (one, or two under expert
        parallelism: its experts apart); the rest hold everything outside the blocks."""
        n = len(blocks)
        owner = {id(p): i for i, blk in enumerate(blocks) for p in blk.parameters()}
        by_block = {i: [] for i in range(n)}
        outer = []
        for b in self.buckets:
            (by_block[owner[id(b.params[0])]] if id(b.params[0]) in owner else outer).append(b)

        def gather(buckets, wait):
            for b in buckets:
                self.gather(b, wait=wait)

        def release(buckets):
            for b in buckets:
                self.release(b)

        def root_pre(_module, _args):
            gather(outer, wait=True)
            gather(by_block[0], wait=False)  # prefetch

        def root_post(_module, _args, _output):
            if torch.is_grad_enabled():
                gather(by_block[n - 1], wait=False)  # backward starts with it
            else:
                release(outer)

        def block_pre(i, _module, _args):
            gather(by_block[i], wait=True)
            if i + 1 < n:
                gather(by_block[i + 1], wait=False)

        def block_backward(i):
            gather(by_block[i], wait=True)
            if i > 0:
                gather(by_block[i - 1], wait=False)

        def block_post(i, _module, _args, output):
            if torch.is_grad_enabled() and output.requires_grad:
                output.register_hook(lambda grad: block_backward(i))
            release(by_block[i])

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
            transport = self.expert_transport if b.expert else self.transport
            self.requests[b.index] = transport.allgather(b.full_mpi(), b.shard_mpi)
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
