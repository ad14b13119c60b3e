"""MPI objects a component creates, released newest first by ``close()``.

Every owner of communicators, windows, persistent requests or files (the process grid,
the gradient engines, the shared-memory arena, the MPI-IO readers) keeps them in one
``MPIResources`` and calls its ``close()`` from its own. Freeing a window or closing a
file is collective, so it happens where every rank is at the same point of the
program: in ``close()``, which owners call on every rank alike, or, for what nobody
closed, at interpreter exit before mpi4py finalizes MPI (``atexit`` runs the newest
registration first, so owners also go in reverse creation order). Never from the
garbage collector, whose timing differs between ranks.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable

from hpctrain.comm.mpi import MPI


class MPIResources:
    def __init__(self):
        self._held: list[tuple[object, Callable[[], None]]] = []
        self._at_exit = False

    def add(self, obj, free: Callable[[], None] | None = None):
        """Own ``obj`` (released by ``free``, default ``obj.Free``); returns ``obj``."""
        if not self._at_exit:
            atexit.register(self.close)
            self._at_exit = True
        self._held.append((obj, free if free is not None else obj.Free))
        return obj

    @property
    def held(self) -> int:
        """How many objects are not released yet."""
        return len(self._held)

    def close(self) -> None:
        """Release everything, newest first (collective where the frees are); a second
        call does nothing. After ``MPI_Finalize`` nothing can be freed, nor needs to be."""
        if self._at_exit:
            atexit.unregister(self.close)
            self._at_exit = False
        held, self._held = self._held, []
        if MPI.Is_finalized():
            return
        for obj, free in reversed(held):
            if obj:  # mpi4py handles are false once null (freed elsewhere, or never made)
                free()
