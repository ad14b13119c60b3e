"""``hpctrain`` command line (``dispatch.main``: the console script and ``python -m hpctrain``)."""

from hpctrain.cli.dispatch import main

__all__ = ["main"]
