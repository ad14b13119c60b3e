"""``MPI``: mpi4py's ``MPI`` module, loaded when first used, so importing never starts MPI.

Importing ``mpi4py.MPI`` initializes MPI. hpctrain's modules write
``from hpctrain.comm.mpi import MPI`` and use it as mpi4py's module: the first attribute
read imports ``mpi4py.MPI``, which initializes MPI exactly as mpi4py does by default
(``mpi4py.rc``: thread level, finalize at exit), after checking that the launcher
belongs to the same MPI (``world_check.py``). Login-node tools and ``--help`` that
never touch MPI never start it. ``tests/test_imports.py`` imports every module and checks.
"""

from __future__ import annotations

import importlib


class _LazyMPI:
    """Stands for ``mpi4py.MPI``. Objects (communicators, constants, classes) are kept
    after their first read, as a plain module attribute costs; functions are read from
    the module at each use, so a test that patches one patches what hpctrain calls."""

    _module = None

    def __getattr__(self, name: str):
        if _LazyMPI._module is None:
            from hpctrain.comm.world_check import check_library_matches_launcher

            check_library_matches_launcher()  # one line, not the MPI's own abort
            _LazyMPI._module = importlib.import_module("mpi4py.MPI")
        value = getattr(_LazyMPI._module, name)
        if isinstance(value, type) or not callable(value):
            self.__dict__[name] = value  # later reads skip __getattr__
        return value

    def __repr__(self) -> str:
        return "<mpi4py.MPI, imported at first use>"


MPI = _LazyMPI()
