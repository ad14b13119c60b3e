"""A typed reader of one TOML table of a system file: every read names its key and
type, a missing required key suggests the nearest spelling, and ``done()`` refuses keys
nobody read (a misspelt optional key would otherwise be ignored)."""

from __future__ import annotations

import difflib

from hpctrain.errors import UserError

REQUIRED = object()
"""The default of a key that must be there."""
EXAMPLE = "hpctrain/systems/polaris.toml"
_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
          list: "a list", dict: "a table"}


class Table:
    """One table of a system file: typed reads, then ``done()`` refuses unread keys.
    ``example``: the file whose comments describe every field (named in errors)."""

    def __init__(self, data, source: str, where: str, example: str = EXAMPLE):
        self.source, self.where, self.example = source, where, example
        if not isinstance(data, dict):
            raise self.error(f"{self.where or 'the file'} must be a table")
        self.data, self.known = data, set()

    def error(self, message: str) -> UserError:
        return UserError(f"system file {self.source}: {message}")

    def key(self, key: str) -> str:
        return f"[{self.where}] {key}" if self.where else key

    def get(self, key: str, typ: type, default=REQUIRED):
        self.known.add(key)
        if key not in self.data:
            if default is REQUIRED:
                close = difflib.get_close_matches(key, list(self.data), n=1)
                hint = f" (is {close[0]} a misspelling of it?)" if close else ""
                raise UserError(f"system file {self.source} lacks {self.key(key)}{hint}; see "
                                f"{self.example} for every field")
            return default
        value = self.data[key]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is not bool):
            raise self.error(f"{self.key(key)} must be {_TYPES[typ]}, not {value!r}")
        return value

    def strings(self, key: str, default=REQUIRED) -> tuple:
        items = self.get(key, list, default)
        if not all(isinstance(s, str) for s in items):
            raise self.error(f"{self.key(key)} must be a list of strings, not {items!r}")
        return tuple(items)

    def numbers(self, key: str, default=REQUIRED) -> dict:
        d = self.get(key, dict, default)
        if d is None:
            return None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.values()):
            raise self.error(f"{self.key(key)} must map names to numbers, not {d!r}")
        return {k: float(v) for k, v in d.items()}

    def table(self, key: str, default=REQUIRED) -> Table | None:
        if key not in self.data and default is REQUIRED:
            where = f"{self.where}.{key}" if self.where else key
            raise UserError(f"system file {self.source} lacks a [{where}] table; see "
                            f"{self.example} for every field")
        d = self.get(key, dict, default)
        return None if d is None else Table(d, self.source,
                                            f"{self.where}.{key}" if self.where else key,
                                            self.example)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.known)
        if unknown:
            raise self.error(f"unknown key(s) {', '.join(unknown)} in "
                             f"{f'[{self.where}]' if self.where else 'the top level'}; "
                             f"known: {', '.join(sorted(self.known))}")
