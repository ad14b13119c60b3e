"""Where rank 0's numbers go besides ``metrics.jsonl``: TensorBoard scalars
(``--train.tensorboard``, through ``torch.utils.tensorboard.SummaryWriter``) and Weights &
Biases (``--train.wandb``, ``wandb_log.py``). ``ScalarLog`` fans each record out to both,
under one set of grouped tags (``TAGS``: ``train/loss``, ``val/loss``, ``perf/mfu``...).

Each record becomes one scalar per numeric field at the record's ``step``, flushed at
once: a log interval's numbers are on disk when its line is, and a run stopped by a signal
or its time limit loses none. Both packages are optional; asking for one without it
installed is refused on every rank before anything trains (``ScalarSinks.check``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpctrain.config.options import FALSE_WORDS, TRUE_WORDS
from hpctrain.errors import ConfigError
from hpctrain.train.wandb_log import WandbLog, wandb_module

NOT_SCALARS = ("step", "started_at", "start_step")
"""Record fields that say where a record is, not what was measured."""

TAGS = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "skipped_steps": "train/skipped_steps",
    "val_loss": "val/loss", "final_val_loss": "val/final_loss",
    "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "tflops_per_device": "perf/tflops_per_device", "step_ms": "perf/step_ms",
    "data_ms": "time/data_ms", "comm_wait_ms": "time/comm_wait_ms",
    "bubble_ms": "time/bubble_ms", "elapsed_s": "time/elapsed_s",
}
"""``metrics.jsonl`` field -> the tag TensorBoard and W&B show it under: the group before
the slash is the panel section both draw it in."""


def tag(key: str) -> str:
    """``key``'s tag: ``TAGS``, else ``memory/`` for a field of bytes, else ``other/``
    (a field added to the records without a group still shows, set apart)."""
    if key in TAGS:
        return TAGS[key]
    return f"memory/{key}" if "bytes" in key or key.startswith("mem") else f"other/{key}"


def scalars_of(record: dict) -> dict[str, float]:
    """A record's finite numbers by tag (None, NaN, booleans and position fields left
    out)."""
    return {tag(key): value for key, value in record.items()
            if key not in NOT_SCALARS and not isinstance(value, bool)
            and isinstance(value, (int, float)) and math.isfinite(value)}


def tensorboard_dir(setting: str, out_dir: str | Path) -> Path | None:
    """The folder ``--train.tensorboard`` names: None when off, ``<out_dir>/tensorboard``
    for ``true``, else the path given."""
    word = setting.strip()
    if word.lower() in FALSE_WORDS:
        return None
    return Path(out_dir) / "tensorboard" if word.lower() in TRUE_WORDS else Path(word)


def summary_writer_class():
    """``SummaryWriter``, or a ``ConfigError`` naming the install when the ``tensorboard``
    package is missing (``torch.utils.tensorboard`` needs it)."""
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it; say so by name)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(f"--train.tensorboard needs the tensorboard package ({e}): run "
                          "`pip install tensorboard` (or `pip install hpctrain[report]`), "
                          "or pass --train.tensorboard=false") from None
    return SummaryWriter


class ScalarLog:
    """Rank 0's event files and W&B run; with neither (the other ranks) every call does
    nothing."""

    def __init__(self, directory: Path | None, writer_class=None, resumed_at: int = 0,
                 wandb: WandbLog | None = None):
        """``resumed_at``: the step a resumed run continues from; TensorBoard then drops
        the earlier attempt's events of later steps (``purge_step``), as ``metrics.jsonl``
        sets their records aside."""
        self.directory = directory
        self._writer = None
        self._wandb = wandb
        if directory is not None:
            writer_class = writer_class or summary_writer_class()
            purge = {"purge_step": resumed_at + 1} if resumed_at else {}
            # Flushed by ``write`` at every log interval, not on the writer's own timer.
            self._writer = writer_class(log_dir=str(directory), max_queue=10_000,
                                        flush_secs=24 * 3600, **purge)

    def write(self, record: dict) -> None:
        """One ``metrics.jsonl`` record: each finite number at ``record["step"]``."""
        if self._writer is None and self._wandb is None:
            return
        step, scalars = int(record["step"]), scalars_of(record)
        if self._writer is not None:
            for name, value in scalars.items():
                self._writer.add_scalar(name, value, global_step=step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


@dataclass(frozen=True)
class ScalarSinks:
    """What ``--train.tensorboard`` and ``--train.wandb`` ask for, their packages found:
    checked on every rank alike at start-up, opened by rank 0."""

    cfg: Any
    tensorboard: Path | None
    writer_class: type | None
    wandb: Any
    """The ``wandb`` module, or None when off."""

    @classmethod
    def check(cls, cfg) -> ScalarSinks:
        """A ``ConfigError`` naming the install for a package that is asked for and
        missing."""
        directory = tensorboard_dir(cfg.train.tensorboard, cfg.train.out_dir)
        return cls(cfg, directory, summary_writer_class() if directory else None,
                   wandb_module(cfg.train.wandb))

    def open(self, is_root: bool, resumed_at: int = 0,
             log: Callable[[str], None] = print) -> ScalarLog:
        """Rank 0's log (the other ranks' does nothing). ``log`` prints the end of run's
        note (where an offline W&B run is, and the command that uploads it)."""
        if not is_root:
            return ScalarLog(None)
        wandb = WandbLog.start(self.wandb, self.cfg, log=log) if self.wandb else None
        return ScalarLog(self.tensorboard, self.writer_class, resumed_at, wandb=wandb)
