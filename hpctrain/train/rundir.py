"""One run per output directory: a lock, and no silent mixing with an earlier run.

Two jobs writing the same ``--train.out_dir`` replace each other's checkpoints and
interleave ``metrics.jsonl``, and a fresh run in an earlier one's directory would prune
or shadow its checkpoints. So before anything is written rank 0 takes the lock
(``rundir_lock.py``), refuses a fresh run over an earlier run's outputs unless told
(``--train.resume=auto`` or ``--train.overwrite``, which move them into
``previous-<UTC time>/``: nothing is deleted), and on a resume from an older step sets
the newer checkpoints aside (``set_aside_newer``). Every rank receives the verdict.
The rules and why: docs/design/failure-handling.md ("One run per output directory").
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpctrain.checkpoint.sharded import (CheckpointError, checkpoint_step, point_latest,
                                         remove_stale_temporaries, resolve)
from hpctrain.comm.small_collectives import bcast_json
from hpctrain.comm.world import World
from hpctrain.output_paths import run_outputs_in
from hpctrain.train.rundir_lock import RunDirError, RunDirLock, describe

def has_checkpoint(out_dir: Path) -> bool:
    return (Path(out_dir) / "checkpoints" / "latest").is_file()


def new_previous_folder(out_dir: Path) -> Path:
    """A new, empty ``<out_dir>/previous-<UTC time>[-n]/`` for outputs moved aside."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = Path(out_dir) / f"previous-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = Path(out_dir) / f"previous-{stamp}-{n}"
    dest.mkdir()
    return dest


def move_aside(out_dir: Path, names: list[str]) -> Path:
    """Move an earlier run's outputs into ``previous-<UTC time>/`` (a rename: nothing is
    copied or deleted)."""
    dest = new_previous_folder(out_dir)
    for name in names:
        os.replace(Path(out_dir) / name, dest / name)
    return dest


def set_aside_newer(out_dir: Path, resume: str) -> str | None:
    """A resume from an older step of this out_dir (a ``step_N`` path, or a ``latest``
    that names one) abandons the checkpoints of higher steps beside it. Left in place,
    they would outrank what the resumed run saves, and pruning (by step) would delete
    the resume source first; so they are moved into ``previous-<UTC time>/checkpoints/``
    (nothing is deleted) and ``latest`` names the resume source. Returns the log note,
    or None when there was nothing to move."""
    root = Path(out_dir) / "checkpoints"
    if not resume or (resume == "auto" and not has_checkpoint(out_dir)):
        return None
    try:
        source = resolve(root if resume == "auto" else resume)
        if source.resolve().parent != root.resolve():
            return None  # another run's checkpoint: nothing here is abandoned
    except (CheckpointError, OSError):
        return None  # loading it names the problem
    step = checkpoint_step(source)
    if step is None:
        return None
    newer = sorted(d for d in root.glob("step_*") if d.is_dir() and not d.is_symlink()
                   and (checkpoint_step(d) or 0) > step)
    if not newer:
        return None
    dest = new_previous_folder(out_dir) / "checkpoints"
    dest.mkdir()
    for d in newer:
        os.replace(d, dest / d.name)
    point_latest(root, source.name)
    return (f"resuming from step {step} abandons the newer checkpoint(s) "
            f"{', '.join(d.name for d in newer)}: moved to {dest} (nothing deleted)")


def _claim(out_dir: Path, resume: str, overwrite: bool, lock: RunDirLock) -> dict:
    """Rank 0's part: the lock and the earlier run. Returns a verdict for every rank."""
    lock.acquire()
    notes = []
    if lock.took_over is not None:
        notes.append(f"took over a stale lock ({describe(lock.took_over)})")
    # Holding the lock, no save of ours is in progress: temporaries are a killed job's.
    stale = remove_stale_temporaries(out_dir / "checkpoints")
    if stale:
        notes.append(f"removed {len(stale)} temporary file(s) of an interrupted save "
                     f"({', '.join(p.name for p in stale[:3])})")
    rollback = set_aside_newer(out_dir, resume)
    if rollback:
        notes.append(rollback)
    found = run_outputs_in(out_dir)  # what an earlier run left there
    continuing = resume not in ("", "auto") or (resume == "auto" and has_checkpoint(out_dir))
    if found and not continuing:
        if resume == "auto":
            notes.append(f"--train.resume=auto found no checkpoint to continue: the earlier "
                         f"attempt's outputs ({', '.join(found)}) moved to "
                         f"{move_aside(out_dir, found)}; starting fresh")
            return {"notes": notes}
        if not overwrite:
            what = ("a checkpoint" if has_checkpoint(out_dir)
                    else "an earlier run's outputs")
            raise RunDirError(
                f"{out_dir} holds {what} ({', '.join(found)}); pass --train.resume=auto to "
                "continue it, --train.overwrite=true to start fresh (its outputs are moved "
                "into a previous-<time>/ folder), or another --train.out_dir")
        notes.append(f"earlier outputs moved to {move_aside(out_dir, found)}")
    return {"notes": notes}


def claim_run_dir(out_dir: Path, resume: str, overwrite: bool, world: World) -> RunDirLock:
    """Collective: rank 0 takes the lock and settles the earlier run; every rank gets
    the verdict (a ``RunDirError`` is raised on all ranks alike). Returns the lock
    (held on rank 0 only) with its log notes in ``lock.notes``."""
    lock = RunDirLock(out_dir)
    verdict = None
    if world.is_root:
        try:
            verdict = _claim(Path(out_dir), resume, overwrite, lock)
        except RunDirError as e:
            verdict = {"error": str(e)}
        except OSError as e:
            verdict = {"error": f"cannot use --train.out_dir={out_dir}: {e}"}
    verdict = bcast_json(world.comm, verdict, timeout=world.timeout,
                         what="output directory check")
    if "error" in verdict:
        lock.release()
        raise RunDirError(verdict["error"])
    lock.notes = verdict["notes"]
    return lock
