"""A ``Config`` as a TOML recipe: what ``--print-config`` prints and the ``config.toml``
every run folder gets, so ``hpctrain train RUN/config.toml`` reproduces the run.

Every option is written, not only those that differ from the defaults: a later release
that changes a default does not change what the file trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpctrain.atomic import temporary_file
from hpctrain.config.sections import Config
from hpctrain.output_paths import RUN_CONFIG, RUN_CONFIG_HEADER, is_run_config


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # a float's repr has a '.' or an exponent; inf and nan are TOML
    # A TOML basic string: JSON's escapes are TOML's, except that TOML also escapes DEL.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def recipe_toml(cfg: Config, *, note: str = "") -> str:
    """``cfg`` as a TOML recipe (every section, every option); ``note`` is a comment
    line under the header (e.g. how to reproduce the run)."""
    lines = [RUN_CONFIG_HEADER] + ([f"# {note}"] if note else [])
    for section, options in cfg.to_dict().items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in options.items()]
    return "\n".join(lines) + "\n"


def write_run_config(out_dir: str | os.PathLike, cfg: Config) -> str:
    """Write ``out_dir/config.toml`` (rank 0, after the run folder is claimed). Returns a
    line for the log when the file is not written: a ``config.toml`` there that is not
    ours (the user's own recipe, kept) or not a regular file."""
    path = Path(out_dir) / RUN_CONFIG
    if os.path.lexists(path) and not is_run_config(path):
        return (f"{path} is not one hpctrain wrote (kept as it is): the run's resolved "
                "config is not written")
    with temporary_file(path) as tmp:
        tmp.write_text(recipe_toml(cfg, note=f"reproduce it: hpctrain train {path} (at the "
                                             "same number of ranks)"), encoding="utf-8")
    return ""
