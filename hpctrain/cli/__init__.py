"""``hpctrain`` command line: ``dispatch.py`` holds ``main`` (the console script and
``python -m hpctrain``) and the table of commands; each command family's module holds its
parsers next to its handlers: ``prepare.py``, ``train.py`` (train, sample), ``jobs.py``
(jobscript, launch), ``ckpt.py``, ``scaling.py`` (scale, plan), ``doctor.py``;
``job_world.py`` builds the world of the commands that run on every rank."""

from hpctrain.cli.dispatch import main

__all__ = ["main"]
