"""The hpctrain command a job runs (everything after ``--``), checked before node time is spent.

    hpctrain jobscript ... -- train RECIPE [--section.key=value ...]
    hpctrain launch ... -- train RECIPE [--section.key=value ...]
    hpctrain jobscript ... --doctor            (the same as '-- doctor': check the node)

The recipe and every override are validated here, on the login node, with the same code
``hpctrain train`` uses, so a typo fails in a second instead of after the queue wait.
"""

from __future__ import annotations

import os

from hpctrain.config import check_layout, load_config, parse_overrides
from hpctrain.errors import ConfigError, JobError
from hpctrain.jobs import validate

RUNNABLE = ("train", "doctor")
DOCTOR_OPTIONS = ("--device", "--gpu-aware", "--sizes", "--model", "--timeout")
"""What a job's ``doctor`` may be given (the job sets ``--json`` itself)."""
ARRAY_INDEX = "{array_index}"
"""In an override of an array job: the sub-job's index (e.g. --train.seed={array_index})."""


def check_command(command: list[str], *, array: bool = False,
                  forbid: dict[str, str] | None = None,
                  ranks: int | None = None) -> tuple[str, list[str]]:
    """``['train', RECIPE, *overrides]`` -> ``(RECIPE, overrides)``, or a ``JobError``.

    ``forbid`` maps options the caller sets itself to the reason the user must drop them.
    With ``ranks`` (the job's rank count) the layout is checked too: pipeline stages that
    do not divide the ranks, or a batch that does not split, fail here, not in the queue.
    """
    example = "-- train default --data.path=datasets/stdlib-char.h5"
    if not command:
        raise JobError(f"name the command to run after '--', e.g. {example}")
    if command[0] not in RUNNABLE:
        raise JobError(f"after '--' comes an hpctrain command ({', '.join(RUNNABLE)}), not "
                       f"{command[0]!r}; e.g. {example}")
    if command[0] == "doctor":
        for item in command[1:]:
            validate.no_nul(item, "the command")
            if item.startswith("-") and item.split("=")[0] not in DOCTOR_OPTIONS:
                raise JobError(f"doctor in a job takes {', '.join(DOCTOR_OPTIONS)}, not "
                               f"{item!r} (its JSON report goes to the run directory)")
        return "", list(command[1:])
    if len(command) < 2 or command[1].startswith("-"):
        raise JobError(f"name a recipe after 'train', e.g. {example}")
    recipe, overrides = command[1], list(command[2:])
    for item in command:
        validate.no_nul(item, "the command")
    checked = [o.replace(ARRAY_INDEX, "0") if array else o for o in overrides]
    try:
        keys = parse_overrides(checked)
        for key, reason in (forbid or {}).items():
            if key in keys:
                raise JobError(f"drop --{key}: {reason}")
        cfg = load_config(recipe, keys)
        if ranks:
            check_layout(cfg, ranks)
    except ConfigError as e:
        raise JobError(f"the training command is invalid: {e}") from None
    return recipe, overrides


def data_warnings(command: list[str], array: bool = False) -> tuple[str, ...]:
    """A warning when a checked training command's ``--data.path`` is not on this machine:
    a typo fails here, not after the queue wait, though a path only the compute nodes see
    (node-local storage, a file system the login node lacks) is fine, hence a warning."""
    if not command or command[0] != "train":
        return ()
    overrides = [o.replace(ARRAY_INDEX, "0") if array else o for o in command[2:]]
    path = load_config(command[1], parse_overrides(overrides)).data.path
    if os.path.exists(path):
        return ()
    return (f"--data.path {path} does not exist on this machine (from {os.getcwd()}): fix "
            "the path, or ignore this if only the compute nodes see it",)
