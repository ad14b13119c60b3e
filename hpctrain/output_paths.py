"""Where a command may write, checked before anything is written: never over a device, a
FIFO, a socket or a link, never over one of its own inputs or into an input folder, never
over another run's outputs; ``--overwrite`` replaces regular files only
(docs/design/failure-handling.md, "Outputs").
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from hpctrain.errors import UserError

RUN_CONFIG = "config.toml"
"""The run's resolved configuration (``config/recipe_file.py``)."""
RUN_CONFIG_HEADER = "# hpctrain: the resolved configuration of a run"
"""Its first line: a ``config.toml`` without it is the user's own recipe, not an output."""
RUN_TRACES = "trace"
"""The run's folder of profiler traces (``--train.profile``: ``rank<r>.json`` each)."""
RUN_OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "final.h5", "sample.txt",
               "tensorboard", "wandb", "report", RUN_TRACES, RUN_CONFIG)
"""What a training run writes into its out_dir; any of them means a run was there."""


def is_run_config(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``config.toml`` hpctrain wrote (a regular file, our header)."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.readline(len(RUN_CONFIG_HEADER) + 2).rstrip("\n") == RUN_CONFIG_HEADER


def run_outputs_in(folder: str | os.PathLike) -> list[str]:
    """The names of ``RUN_OUTPUTS`` present in ``folder`` (a user's own ``config.toml``
    there is not one)."""
    return [name for name in RUN_OUTPUTS if os.path.lexists(Path(folder) / name)
            and (name != RUN_CONFIG or is_run_config(Path(folder) / name))]


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def check_not_an_input(output: Path, inputs: Iterable, option: str, error: type) -> None:
    """Refuse ``output`` when it is one of ``inputs`` (a file or a folder) or lies inside
    an input folder (a checkpoint read from it, say)."""
    for given in inputs:
        src = Path(given)
        if _same(output, src):
            raise error(f"{option} {output} is one of the inputs; write the output "
                        "somewhere else (the inputs are never replaced)")
        if src.is_dir() and _inside(output, src) and not _is_run_folder_root(src, output):
            raise error(f"{option} {output} is inside the input {src}; write it outside "
                        "the inputs")


def _is_run_folder_root(src: Path, output: Path) -> bool:
    """A run's out_dir named as a checkpoint (its latest): an output beside its files,
    not inside a checkpoint, is allowed (``RUN_OUTPUTS`` are guarded by name)."""
    return bool(run_outputs_in(src)) and not _inside(output, src / "checkpoints")


def check_output_file(output: str | os.PathLike, *, option: str = "--output",
                      inputs: Iterable = (), overwrite: bool | None = None,
                      example: str = "out.h5", error: type = UserError) -> Path:
    """The checked path of a file to write. ``overwrite``: False refuses an existing
    file, True replaces a regular one; None replaces a regular one too (an output made
    from the inputs again, such as a merged checkpoint). Anything else already there (a
    directory, device, FIFO, socket or link) is refused whatever ``overwrite`` says."""
    out = Path(output)
    try:
        mode = os.lstat(out).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and stat.S_ISDIR(mode):
        raise error(f"{option} {out} is a directory; name the file to write, e.g. "
                    f"{option} {out / example}")
    if mode is not None and not stat.S_ISREG(mode):
        raise error(f"{option} {out} is not a regular file (a device, FIFO, socket or "
                    "link), which is never replaced; name a new file")
    if mode is not None and overwrite is False:
        raise error(f"{option} {out} exists; add --overwrite to replace it, or choose "
                    "another name")
    check_not_an_input(out, inputs, option, error)
    if out.name in RUN_OUTPUTS and run_outputs_in(out.parent):
        raise error(f"{option} {out} would replace an output of the run in {out.parent}; "
                    "write it somewhere else")
    return out


def check_output_folder(output: str | os.PathLike, *, option: str = "--output",
                        inputs: Iterable = (), new: bool = True,
                        error: type = UserError) -> Path:
    """The checked path of a folder to write. ``new``: it must not exist; otherwise an
    existing folder is written into, unless it holds a training run's outputs."""
    out = Path(output)
    if os.path.lexists(out) and (new or not out.is_dir() or out.is_symlink()):
        raise error(f"{option} {out} exists; choose a new {option} directory (nothing is "
                    "ever replaced)")
    if out.is_dir() and run_outputs_in(out):
        raise error(f"{option} {out} holds a training run ({', '.join(run_outputs_in(out))}); "
                    "choose another directory")
    check_not_an_input(out, inputs, option, error)
    return out
