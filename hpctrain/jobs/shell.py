"""Bash words for rendered job scripts: a user's string can never become code.

Every value a user gives (recipe, override, environment value, path) reaches the script
through ``quote``, which returns one bash word that expands to exactly that string, on
one line whatever it contains: quotes, ``$()``, backticks and newlines included.
Directive values (job name, account, queue) are not quoted but validated against a
small character set instead (``validate.py``), because PBS and SLURM parse them.

A launch line is built once, as a list of ``Word``s, and then either rendered into a
script (where node and rank counts are shell variables known only inside the job) or
resolved to a plain ``argv`` by ``hpctrain launch`` (where they are numbers).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

# shlex.quote leaves these alone; anything else gets quoted.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


class Shell(str):
    """Text that is safe to paste into a bash script as it is.

    Only three things are ``Shell``: the output of ``quote``/``render_word``, directive
    values that passed validation, and the trusted code of a system file. The
    template engine refuses to print a plain ``str`` (see ``render.py``).
    """


@dataclass(frozen=True)
class Var:
    """A shell variable inside a rendered script, e.g. ``Var("NRANKS")`` -> ``"${NRANKS}"``."""

    name: str


Word = tuple  # tuple[str | Var, ...]: the parts of one argument, concatenated


def quote(value) -> Shell:
    """One bash word, on one line, that expands to exactly ``str(value)``."""
    text = str(value)
    if "\x00" in text:
        raise ValueError("a NUL byte cannot be passed through a shell")
    if not _CONTROL.search(text):
        return Shell(shlex.quote(text))
    # bash's ANSI-C quoting ($'...') spells newlines and other control characters as
    # escapes, so the word stays on one line (it cannot end a comment or directive).
    body = "".join(_ANSI_C.get(c) or (f"\\x{ord(c):02x}" if _CONTROL.match(c) else c)
                   for c in text)
    return Shell(f"$'{body}'")


def word(*parts) -> Word:
    """A word from literal strings and ``Var``s: ``word("--train.out_dir=", Var("RUN_DIR"))``."""
    return tuple(p for p in parts if p != "")


def literal(text: str) -> Word:
    return (text,)


def render_word(w: Word) -> Shell:
    """The bash spelling of ``w``: literals quoted, variables as ``"${NAME}"``."""
    if not w:
        return Shell("''")
    return Shell("".join(f'"${{{p.name}}}"' if isinstance(p, Var) else quote(p) for p in w))


def resolve_word(w: Word, values: dict[str, str] | None = None) -> str:
    """The string ``w`` stands for, with each variable looked up in ``values``."""
    values = values or {}
    out = []
    for p in w:
        if isinstance(p, Var):
            if p.name not in values:
                raise KeyError(f"no value for ${p.name}")
            out.append(values[p.name])
        else:
            out.append(p)
    return "".join(out)


def render_words(words) -> Shell:
    return Shell(" ".join(render_word(w) for w in words))


def with_home(path: str) -> Word:
    """A path word where a leading ``~/`` means ``$HOME`` (the rest stays quoted)."""
    if path == "~":
        return (Var("HOME"),)
    if path.startswith("~/"):
        return word(Var("HOME"), path[1:])
    return literal(path)


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def expand(template: str, values: dict[str, Word]) -> Word:
    """Fill ``{name}`` placeholders of a trusted system-file template with words."""
    parts: list = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        parts.append(template[pos:m.start()])
        parts.extend(values[m.group(1)])
        pos = m.end()
    parts.append(template[pos:])
    # Merge adjacent literals so that "-N" + "4" renders as one quoted chunk.
    merged: list = []
    for p in parts:
        if p == "":
            continue
        if merged and isinstance(p, str) and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    return tuple(merged)


def placeholders(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))
