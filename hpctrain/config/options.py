"""How a config section declares an option and how a value becomes one.

``opt(default, help, choices=..., bounds=...)`` declares a field with its help text and
its allowed values or range; ``check_fields`` holds a section to them in its
``__post_init__``; ``coerce`` turns a recipe's value or the command line's text into the
field's type; ``parse_hints`` reads ``--data.romio_hints``. Nothing here knows the
sections themselves (``sections.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass, field

from hpctrain.errors import ConfigError
from hpctrain.sizes import MAX_COUNT


@dataclass(frozen=True)
class Bounds:
    """The valid range of a number field. Float fields must also be finite: a NaN slips
    through every comparison (``nan > 0`` and ``nan <= 0`` are both false), and an
    infinite value means something else than the user meant (``--comm.timeout=inf``
    would turn the watchdog off, ``--optim.lr=inf`` ruins the model at the first step)."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False  # low itself is not allowed
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is None:  # no count is endless (hpctrain.sizes)
            return not isinstance(value, int) or value <= MAX_COUNT
        return value < self.high if self.high_open else value <= self.high

    def describe(self, typ: type) -> str:
        """``at least 1``, ``a finite number > 0``, ``a finite number in [0, 1)``."""
        num = (lambda v: f"{v:g}") if typ is float else str
        finite = "a finite number " if typ is float else ""
        if self.high is None:
            if typ is int and not self.low_open:
                return f"at least {self.low}"
            return f"{finite}{'>' if self.low_open else '>='} {num(self.low)}"
        return (f"{finite}in {'(' if self.low_open else '['}{num(self.low)}, "
                f"{num(self.high)}{')' if self.high_open else ']'}")


AT_LEAST_0, AT_LEAST_1 = Bounds(0), Bounds(1)
POSITIVE = Bounds(0, low_open=True)
FRACTION = Bounds(0, 1, high_open=True)  # [0, 1)
SHARE = Bounds(0, 1, low_open=True)  # (0, 1]


def opt(default, help: str, choices: tuple | None = None, bounds: Bounds | None = None):
    """A config field with its help text and, optionally, its allowed values (``choices``)
    or range (``bounds``; every int and float field without choices has one)."""
    return field(default=default, metadata={"help": help, "choices": choices,
                                            "bounds": bounds})


@functools.cache
def field_types(cls: type) -> dict[str, type]:
    """``typing.get_type_hints`` of a config dataclass, resolved once per class: every
    config built (a test builds thousands) asks for each section's."""
    return typing.get_type_hints(cls)


def check_fields(section, name: str) -> None:
    """Each field of ``section`` (the section called ``name``) against its choices or
    bounds; the message names the option and the valid values, so ``--optim.eps=-1`` or
    ``--comm.timeout=nan`` never reaches training."""
    hints = field_types(type(section))
    for f in dataclasses.fields(section):
        key, value = f"{name}.{f.name}", getattr(section, f.name)
        choices, bounds = f.metadata.get("choices"), f.metadata.get("bounds")
        if choices and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")
        if bounds is not None and value not in bounds:
            if bounds.high is None and isinstance(value, int) and value > MAX_COUNT:
                raise ConfigError(f"{key} must be at most {MAX_COUNT}, not {value!r}")
            raise ConfigError(f"{key} must be {bounds.describe(hints[f.name])}, not {value!r}")


def require(ok: bool, message: str) -> None:
    """A section's own check: ``message`` (naming the fix) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
"""How a switch is spelled on the command line, either way."""


class SwitchOrPath(str):
    """The type of an option that is on, off or a path (``--train.tensorboard``): text,
    and in a recipe also a TOML boolean (``true`` is "true")."""


def coerce(key: str, value, typ):
    """``value`` (from a recipe, or text from the command line) as the option's type
    ``typ``; ``key`` names the option in the message when it is not one."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_WORDS:
            return True
        if isinstance(value, str) and value.lower() in FALSE_WORDS:
            return False
    elif typ in (int, float):
        numbers = int if typ is int else (int, float)  # an int is a float's value too
        if (isinstance(value, numbers) and not isinstance(value, bool)) or isinstance(value, str):
            try:
                return typ(value)
            except ValueError:
                pass
    elif typ is SwitchOrPath and isinstance(value, bool):
        return "true" if value else "false"
    elif typ in (str, SwitchOrPath):
        if isinstance(value, str):
            return value
    wanted = "true, false or a path" if typ is SwitchOrPath else typ.__name__
    raise ConfigError(f"--{key} expects {wanted}, got {value!r}")


def parse_step_range(key: str, text: str, most: int) -> range:
    """Training steps as typed: ``"20"`` is step 20, ``"20-22"`` steps 20 to 22 (both
    counted, the trainer's 1-based numbers), ``""`` none; ``key`` names the option in the
    message; at most ``most`` steps."""
    text = text.strip()
    if not text:
        return range(0)
    m = re.fullmatch(r"(\d{1,9})(?:\s*-\s*(\d{1,9}))?", text)
    first, last = (int(m[1]), int(m[2] or m[1])) if m else (0, -1)
    if not m or first < 1 or last < first:
        raise ConfigError(f"--{key} takes a step or a range of steps, e.g. 20 or 20-22 "
                          f"(from step 1, the first not above the last), not {text!r}")
    if last - first + 1 > most:
        raise ConfigError(f"--{key}={text} names {last - first + 1} steps; at most {most}: "
                          f"give a shorter range")
    return range(first, last + 1)

_HINT_KEY = re.compile(r"^[A-Za-z0-9_]+$")


def parse_hints(text: str) -> dict[str, str]:
    """ROMIO hints (``hpctrain.data.hints`` lists the keys that matter):
    ``"striping_factor=8,romio_cb_read=enable"`` -> ``{"striping_factor": "8", ...}``."""
    hints = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _HINT_KEY.match(key) or not value:
            raise ConfigError(f"ROMIO hints look like key=value,key=value (e.g. "
                              f"romio_cb_read=enable,cb_nodes=8,striping_factor=8), not {text!r}")
        hints[key] = value
    return hints
