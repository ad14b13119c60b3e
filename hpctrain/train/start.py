"""Where a run starts: the checkpoint it resumes (``--train.resume``), the weights a new
run begins from (``--train.init_from``), or step 0 with the seed's weights.

A checkpoint to resume wins over ``init_from`` (``--train.resume=auto`` with
``init_from``: a requeued job continues instead of starting over).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpctrain.checkpoint.distributed import find_resume, load_sharded
from hpctrain.checkpoint.init_from import load_initial_weights
from hpctrain.checkpoint.sharded import read_manifest
from hpctrain.comm.grid import ProcessGrid
from hpctrain.config import Config, ConfigError

RESUME_KEYS = ("train.seed", "train.batch_size", "data.path", "data.sampler")
"""Settings a resumed run may change, though its batches then differ from the ones the
run would have drawn (the sampler is a function of seed, batch and data): warned of."""


@dataclass(frozen=True)
class StartingPoint:
    step: int = 0
    """The step the loaded checkpoint ends with (0: a new run)."""
    weights_from: str = ""
    """The checkpoint a new run took its initial weights from (``init_from``), if any."""
    changed: tuple[str, ...] = ()
    """``RESUME_KEYS`` this resume changes, as ``key: before -> now``."""

    def describe(self) -> str:
        """The start-up line that says where the run starts ('' for a fresh run)."""
        if self.step:
            changed = (f"; warning: changed since that run: {', '.join(self.changed)} (its "
                       "batches differ from the run's own)") if self.changed else ""
            return f"resumed from the checkpoint of step {self.step}{changed}"
        if self.weights_from:
            return (f"weights from {self.weights_from}; the optimizer and the "
                    "learning-rate schedule start fresh")
        return ""


def load_starting_point(cfg: Config, out_dir: Path, engine, grid: ProcessGrid, runner,
                        model_shape: dict, tokenizer_meta: dict) -> StartingPoint:
    """Load what the run starts from into ``engine`` (collective: every rank calls it)."""
    t = cfg.train
    resume_from = find_resume(t.resume, out_dir)
    if resume_from is not None:
        step = load_sharded(resume_from, engine, grid, model_shape=model_shape)
        runner.tie_weights()  # a pipeline's head copy of the embedding
        if step > t.max_iters:
            raise ConfigError(f"the checkpoint is at step {step}, past "
                              f"--train.max_iters={t.max_iters}; raise max_iters to go on")
        return StartingPoint(step=step, changed=changed_settings(
            read_manifest(resume_from).data.get("config") or {}, cfg.to_dict()))
    if t.init_from:  # resume=auto found nothing to resume: a new run from weights
        load_initial_weights(t.init_from, engine, model_shape=model_shape,
                             tokenizer=tokenizer_meta)
        runner.tie_weights()
        return StartingPoint(weights_from=t.init_from)
    return StartingPoint()


def changed_settings(before: dict, now: dict) -> tuple[str, ...]:
    """``RESUME_KEYS`` whose value differs between two configs' dicts (one a
    checkpoint's: a key it lacks is not a change)."""
    out = []
    for key in RESUME_KEYS:
        section, name = key.split(".")
        old = before.get(section) or {}
        if name in old and old[name] != now[section][name]:
            out.append(f"{key}: {old[name]!r} -> {now[section][name]!r}")
    return tuple(out)
