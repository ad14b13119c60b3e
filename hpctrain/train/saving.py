"""Periodic sharded checkpoints of a run, synchronous or asynchronous.

An asynchronous save (``--train.ckpt_async``) copies the state into host buffers kept
for the run and a thread writes it while training goes on; at most one is in flight.
After every step ``poll`` asks every rank whether its writer is done (a small allreduce
from the main thread, only while a save is in flight) and publishes the checkpoint once
all are; the next save, the end and a stop wait for it (``finish_pending``).
What waits for what, and the failure cases: docs/design/checkpoints.md."""

from __future__ import annotations

import time
from pathlib import Path

from hpctrain.checkpoint.distributed import PendingSave, begin_save
from hpctrain.checkpoint.host_buffers import HostBuffers
from hpctrain.checkpoint.sharded import wait_for_pruning
from hpctrain.comm.small_collectives import any_true


class CheckpointSaver:
    def __init__(self, root: Path, engine, grid, run: dict, keep: int, log, on_saved=None):
        """``run``: the manifest's ``config``, ``model`` and ``tokenizer`` records;
        ``log(line)`` prints on rank 0; ``on_saved(seconds)`` hears how long each save
        took, an asynchronous one from its start to its publication (the deadline's
        margin: a stop waits for it, then saves again)."""
        self.root, self.engine, self.grid = root, engine, grid
        self.run, self.keep, self.log, self.on_saved = run, keep, log, on_saved
        self._pending: PendingSave | None = None
        self._buffers: HostBuffers | None = None  # made at the first asynchronous save
        self._began, self._warned = 0.0, False
        self.saved_step: int | None = None
        """The step of the newest checkpoint this run published (None: none yet)."""
        self.overlapped: dict[int, int] = {}
        """Asynchronous checkpoints published: step -> the steps trained while it was
        written."""

    def save(self, step: int, asynchronous: bool = False) -> Path | None:
        """Every rank writes its shard of ``<root>/step_<step>`` (collective). The write
        is never cut short by a stop: it is published whole (renamed into place) or not at
        all, and the trainer asks for a stop right after it (``saved_step``). An
        asynchronous save returns at once (None) and is published later."""
        self.finish_pending()  # one in flight at most; its buffers are free after this
        t0 = time.perf_counter()
        if asynchronous and self._buffers is None:
            self._buffers = HostBuffers()
        pending = begin_save(self.root, step, self.engine, self.grid, run=self.run,
                             keep=self.keep, buffers=self._buffers if asynchronous else None)
        if pending.note and not self._warned:
            self._warned = True
            self.log(f"warning: {pending.note}")
        if pending.in_background:
            self._pending, self._began = pending, t0
            self.overlapped[step] = 0
            return None
        path = pending.finish()
        self.saved_step = step
        if self.on_saved is not None:
            self.on_saved(time.perf_counter() - t0)
        self.log(f"checkpoint: {path}")
        return path

    def poll(self) -> None:
        """After every step, on every rank: publish the asynchronous save once every
        rank's writer is done (collective while one is in flight, nothing otherwise)."""
        if self._pending is None:
            return
        self.overlapped[self._pending.step] += 1
        w = self.grid.world
        if not any_true(w.comm, not self._pending.written, timeout=w.timeout,
                        what=f"checkpoint save (step {self._pending.step}): written?"):
            self.finish_pending()

    def finish_pending(self, end: bool = False) -> None:
        """Wait for the asynchronous save and publish it (collective: every rank at the
        same step). A failed write raises the synchronous save's error on every rank.
        ``end`` (the loop's last call): also wait until the checkpoints beyond
        ``--train.ckpt_keep`` are deleted (``prune_in_background``)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            path = pending.finish()
            if self.on_saved is not None:
                self.on_saved(time.perf_counter() - self._began)
            self.log(f"checkpoint: {path} (written during {self.overlapped[pending.step]} "
                     "training step(s))")
            self.saved_step = pending.step
        if end:
            wait_for_pruning()
