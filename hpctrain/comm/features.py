"""What the MPI library can do, found by trying it rather than by its version number.

``MPI_Get_version`` names the standard a library claims in full, not the calls it has:
Open MPI 5 reports 3.1 and provides ``MPI_Allreduce_init``, while Open MPI 4.1 (also
3.1) lacks it and mpi4py raises ``NotImplementedError``. So each feature is probed with
one real call, and the ranks agree on the answer: a collective path that some ranks take
and others do not would deadlock.
"""

from __future__ import annotations

import numpy as np

from hpctrain.comm.mpi import MPI
from hpctrain.comm.small_collectives import allreduce_array


def persistent_collectives(comm: MPI.Comm, timeout: float = 300.0) -> bool:
    """True when ``comm.Allreduce_init`` (MPI-4 persistent collectives) works on every
    rank of ``comm``. Collective; the agreement waits at most ``timeout`` seconds."""
    ok = True
    try:
        probe = comm.Allreduce_init(MPI.IN_PLACE, np.zeros(1), op=MPI.SUM)
    except (AttributeError, NotImplementedError, MPI.Exception):
        ok = False
    else:
        probe.Free()
    return bool(allreduce_array(comm, [int(ok)], timeout=timeout, op=MPI.MIN,
                                what="agreeing on persistent collectives")[0])
