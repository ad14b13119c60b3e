"""Periodic sharded checkpoints of a run, in the foreground or in the background.

A background save copies the shards in memory and writes them in a thread; it is
published (manifest, rename) by ``finish_pending`` at the next point where every rank
is: the next log step, before another save, and at the end."""

from __future__ import annotations

from pathlib import Path

from hpctrain.checkpoint.collective import PendingSave, begin_save


class CheckpointSaver:
    def __init__(self, root: Path, engine, grid, run: dict, keep: int, log):
        """``run``: the manifest's ``config``, ``model`` and ``tokenizer`` records;
        ``log(line)`` prints on rank 0."""
        self.root, self.engine, self.grid = root, engine, grid
        self.run, self.keep, self.log = run, keep, log
        self._pending: PendingSave | None = None

    def save(self, step: int, background: bool = False) -> Path | None:
        """Every rank writes its shard of ``<root>/step_<step>`` (collective)."""
        self.finish_pending()
        pending = begin_save(self.root, step, self.engine, self.grid, run=self.run,
                             keep=self.keep, background=background)
        if background:
            self._pending = pending
            return None
        path = pending.finish()
        self.log(f"checkpoint: {path}")
        return path

    def finish_pending(self) -> None:
        """Publish a background checkpoint (collective: every rank at the same step)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.log(f"checkpoint: {pending.finish()}")
