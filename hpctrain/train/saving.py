"""Periodic sharded checkpoints of a run, in the foreground or in the background.

A background save copies the shards in memory and writes them in a thread; it is
published (manifest, rename) by ``finish_pending`` at the next point where every rank
is: the next log step, before another save, and at the end."""

from __future__ import annotations

import time
from pathlib import Path

from hpctrain.checkpoint.distributed import PendingSave, begin_save


class CheckpointSaver:
    def __init__(self, root: Path, engine, grid, run: dict, keep: int, log, on_saved=None):
        """``run``: the manifest's ``config``, ``model`` and ``tokenizer`` records;
        ``log(line)`` prints on rank 0; ``on_saved(seconds)`` hears how long each
        foreground save took (the deadline's margin)."""
        self.root, self.engine, self.grid = root, engine, grid
        self.run, self.keep, self.log, self.on_saved = run, keep, log, on_saved
        self._pending: PendingSave | None = None
        self.saved_step: int | None = None
        """The step of the newest checkpoint this run published (None: none yet)."""

    def save(self, step: int, background: bool = False) -> Path | None:
        """Every rank writes its shard of ``<root>/step_<step>`` (collective). The write
        is never cut short by a stop: it is published whole (renamed into place) or not at
        all, and the trainer asks for a stop right after it (``saved_step``)."""
        self.finish_pending()
        t0 = time.perf_counter()
        pending = begin_save(self.root, step, self.engine, self.grid, run=self.run,
                             keep=self.keep, background=background)
        if background:
            self._pending = pending
            return None
        path = pending.finish()
        self.saved_step = step
        if self.on_saved is not None:
            self.on_saved(time.perf_counter() - t0)
        self.log(f"checkpoint: {path}")
        return path

    def finish_pending(self) -> None:
        """Publish a background checkpoint (collective: every rank at the same step)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.log(f"checkpoint: {pending.finish()}")
            self.saved_step = pending.step
