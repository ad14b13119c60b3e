"""``--train.tensorboard``: the numbers of every ``metrics.jsonl`` record as TensorBoard
scalars, written by rank 0 through ``torch.utils.tensorboard.SummaryWriter``.

Each record becomes one scalar per numeric field (its name as in ``metrics.jsonl``, at
the record's ``step``), flushed at once: a log interval's numbers are on disk when its
line is, and a run stopped by a signal or its time limit loses none. The package is
optional (``pip install tensorboard``); asking for it without it installed is refused
before anything trains."""

from __future__ import annotations

import math
from pathlib import Path

from hpctrain.config.options import FALSE_WORDS, TRUE_WORDS
from hpctrain.errors import ConfigError

NOT_SCALARS = ("step", "started_at", "start_step")
"""Record fields that say where a record is, not what was measured."""


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
    """Rank 0's event files; on the other ranks (``directory`` None) every call does
    nothing."""

    def __init__(self, directory: Path | None, writer_class=None, resumed_at: int = 0):
        """``resumed_at``: the step a resumed run continues from; TensorBoard then drops
        the earlier attempt's events of later steps (``purge_step``), as ``metrics.jsonl``
        sets their records aside."""
        self.directory = directory
        self._writer = None
        if directory is not None:
            writer_class = writer_class or summary_writer_class()
            purge = {"purge_step": resumed_at + 1} if resumed_at else {}
            # Flushed by ``write`` at every log interval, not on the writer's own timer.
            self._writer = writer_class(log_dir=str(directory), max_queue=10_000,
                                        flush_secs=24 * 3600, **purge)

    def write(self, record: dict) -> None:
        """One ``metrics.jsonl`` record: each finite number at ``record["step"]``."""
        if self._writer is None:
            return
        step = int(record["step"])
        for key, value in record.items():
            if key in NOT_SCALARS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
