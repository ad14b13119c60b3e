"""From a recipe (built-in or a TOML file) and ``--section.key=value`` overrides to a
validated ``Config``; and every option with its help, for ``--help``."""

from __future__ import annotations

import dataclasses
import difflib
import sys
from importlib import resources
from pathlib import Path

from hpctrain.comm.abort import env_rank
from hpctrain.config.options import coerce, field_types
from hpctrain.config.sections import SECTION_TYPES, Config
from hpctrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def recipe_names() -> list[str]:
    root = resources.files("hpctrain.recipes")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


MAX_RECIPE_BYTES = 1 << 20
"""A recipe is a few sections of keys: a larger file is not one."""


def read_recipe(name_or_path: str) -> dict:
    """A built-in recipe by name, or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file {path} does not exist")
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise ConfigError(f"recipe file {path} is {path.stat().st_size:,} bytes, more "
                              f"than any recipe ({MAX_RECIPE_BYTES:,}); name a recipe file")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"recipe file {path} is not UTF-8 text (byte {e.start}); name "
                              "a TOML recipe file") from None
    else:
        resource = resources.files("hpctrain.recipes") / f"{name_or_path}.toml"
        if not resource.is_file():
            raise ConfigError(f"unknown recipe {name_or_path!r}; built-in recipes: "
                              f"{', '.join(recipe_names())} (or give a path to a .toml file)")
        text = resource.read_text()
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {name_or_path} is not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"recipe {name_or_path} nests its values deeper than Python's "
                          "parser goes; a recipe is sections of plain keys") from None


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in SECTION_TYPES.items() for f in dataclasses.fields(cls)]


# Options that were renamed: the old name gets a message naming the new one.
RENAMED = {"comm.cuda_aware": "comm.gpu_aware", "comm.device": "train.device"}
# Options renamed in this release: the old name still works, with the same values, and
# prints one line naming the new one; the next release moves them to RENAMED. Both
# old transport options chose how gradients move, so both became --comm.transport;
# the background checkpoints became the asynchronous ones.
DEPRECATED = {"comm.collectives": "comm.transport", "parallel.allreduce": "comm.transport",
              "data.stage_dir": "data.local_copy_dir",
              "train.ckpt_background": "train.ckpt_async"}


def deprecation_line(old: str, new: str) -> str:
    """The one line every renamed option or flag prints while its old name still works."""
    return f"warning: {old} is deprecated (removed in the next release): {old} -> {new}"


def _deprecated_to_new(flat: dict, *, warn: bool) -> dict:
    """``flat`` with every DEPRECATED key under its new name. The new name, when given,
    wins; old names that say different things (other than auto) are refused."""
    out = {k: v for k, v in flat.items() if k not in DEPRECATED}
    for old, new in DEPRECATED.items():
        if old not in flat:
            continue
        if warn and env_rank() == 0:
            print(deprecation_line(f"--{old}", f"--{new}"), file=sys.stderr, flush=True)
        value = str(flat[old])
        if new in flat or value == "auto":
            out.setdefault(new, value)
            continue
        if str(out.get(new, "auto")) not in ("auto", value):
            givers = [f"--{k}={flat[k]}" for k in DEPRECATED if DEPRECATED[k] == new and k in flat]
            raise ConfigError(f"{' and '.join(givers)} disagree; give --{new} once")
        out[new] = value
    return out


def _unknown(key: str) -> ConfigError:
    if key in RENAMED:
        return ConfigError(f"--{key} is now --{RENAMED[key]} (same values); rename it in "
                           "your recipe or command line")
    close = difflib.get_close_matches(key, _all_keys(), n=1)
    hint = f"; did you mean --{close[0]}?" if close else "; see `hpctrain train RECIPE --help`"
    return ConfigError(f"unknown option --{key}{hint}")


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``['--train.max_iters=5', '--model.bias', 'true']`` -> ``{'train.max_iters': '5', ...}``."""
    out, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {arg!r}; options look like "
                              "--section.key=value (e.g. --train.max_iters=100)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value, e.g. {arg}=VALUE")
            key, value = arg[2:], args[i + 1]
            i += 2
        out[key] = value
    return out


def build_config(recipe: dict, overrides: dict[str, str] | None = None, *,
                 warn: bool = True) -> Config:
    """Merge a recipe dict and dotted overrides into a validated ``Config``. ``warn``: say
    so when a deprecated option is used (not for a config a run saved)."""
    values: dict[str, dict] = {name: {} for name in SECTION_TYPES}
    flat = {}
    for section, entries in recipe.items():
        if section not in SECTION_TYPES or not isinstance(entries, dict):
            raise ConfigError(f"recipe has unknown section [{section}]; sections are "
                              f"{', '.join(SECTION_TYPES)}")
        for key, value in entries.items():
            flat[f"{section}.{key}"] = value
    flat.update(overrides or {})
    flat = _deprecated_to_new(flat, warn=warn)
    for dotted, value in flat.items():
        section, _, key = dotted.partition(".")
        cls = SECTION_TYPES.get(section)
        hints = field_types(cls) if cls else {}
        if key not in hints:
            raise _unknown(dotted)
        values[section][key] = coerce(dotted, value, hints[key])
    sections = {name: cls(**values[name]) for name, cls in SECTION_TYPES.items()}
    return Config(**sections)


def load_config(recipe: str, overrides: list[str] | dict | None = None) -> Config:
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    return build_config(read_recipe(recipe), overrides)


def config_from_dict(d: dict) -> Config:
    """Rebuild a config saved with ``Config.to_dict`` (checkpoints, records)."""
    return build_config({k: v for k, v in d.items() if isinstance(v, dict)}, warn=False)


def describe_options(recipe: str | None = None, overrides: list[str] | None = None) -> str:
    """Every option with its value and help, for ``--help``: the built-in defaults, or,
    with a recipe, the values it (and ``overrides``) resolve to, each set one marked."""
    cfg, given = None, {}
    if recipe:
        flat = parse_overrides(overrides or [])
        cfg = build_config(read_recipe(recipe), flat, warn=False)
        given = {f"{s}.{k}": "recipe" for s, kv in read_recipe(recipe).items()
                 if isinstance(kv, dict) for k in kv}
        given.update({DEPRECATED.get(k, k): "command line" for k in flat})
    lines = []
    for section, cls in SECTION_TYPES.items():
        lines.append(f"[{section}]")
        hints = field_types(cls)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            value = getattr(getattr(cfg, section), f.name) if cfg else f.default
            choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
            extra = f" ({'|'.join(map(str, choices))})" if choices else ""
            extra += f" ({bounds.describe(hints[f.name])})" if bounds else ""
            if key in given:
                extra += f"  [set by the {given[key]}; default {f.default!r}]"
            lines.append(f"  --{key}={value!r}{extra}\n      {f.metadata['help']}")
    return "\n".join(lines)
