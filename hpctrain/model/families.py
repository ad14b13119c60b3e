"""The model families ``--model.arch`` chooses from, by name.

GPT-2 and Llama are built in; ``register_family`` adds one (a test-only family does, to
prove that ``parallel/`` needs nothing of a model but its plan: docs/design/models.md).
"""

from __future__ import annotations

from hpctrain.model.family import Family
from hpctrain.model.gpt2 import FAMILY as GPT2
from hpctrain.model.llama import FAMILY as LLAMA

_FAMILIES: dict[str, Family] = {f.arch: f for f in (GPT2, LLAMA)}


def register_family(family: Family) -> None:
    """Make ``family`` buildable as ``--model.arch=<family.arch>`` in this process."""
    known = _FAMILIES.get(family.arch)
    if known is not None and known is not family:
        raise ValueError(f"a model family named {family.arch!r} exists already")
    _FAMILIES[family.arch] = family


def family_of(arch: str) -> Family:
    """The family called ``arch``; ValueError naming the known ones otherwise."""
    try:
        return _FAMILIES[arch]
    except (KeyError, TypeError):
        raise ValueError(f"model arch {arch!r} is not one of {', '.join(ARCHS)}") from None


class _Archs:
    """The names of the registered families, as the config's choices for ``arch``
    (read when a value is checked, so a family registered later counts)."""

    def __iter__(self):
        return iter(tuple(_FAMILIES))

    def __contains__(self, arch) -> bool:
        return arch in _FAMILIES

    def __repr__(self) -> str:
        return repr(tuple(_FAMILIES))


ARCHS = _Archs()
