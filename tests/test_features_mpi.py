"""Feature probes over real MPI ranks (run under ``mpiexec -n 2`` and ``-n 4``): the
persistent-collective probe tries the call rather than trusting ``MPI_Get_version``, and
every rank gets the same answer."""

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm.features import persistent_collectives

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


def _allreduce_init_works(comm) -> bool:
    try:
        req = comm.Allreduce_init(MPI.IN_PLACE, np.zeros(1), op=MPI.SUM)
    except NotImplementedError:
        return False
    req.Free()
    return True


def test_the_probe_answers_what_the_call_does_on_every_rank():
    got = persistent_collectives(COMM)
    assert COMM.allgather(got) == [got] * COMM.size
    assert got == _allreduce_init_works(COMM)
    if got:  # and the persistent reduction it promises sums
        buf = np.full(3, float(COMM.rank + 1))
        req = COMM.Allreduce_init(MPI.IN_PLACE, buf, op=MPI.SUM)
        req.Start()
        req.Wait()
        req.Free()
        assert buf.tolist() == [COMM.size * (COMM.size + 1) / 2] * 3


def test_one_rank_without_the_feature_turns_it_off_everywhere():
    class Without:
        """Fails the probe on this rank only (the real call is still made, so that the
        collective initialization matches on every rank)."""

        def __init__(self, comm):
            self._comm = comm

        def Allreduce_init(self, *args, **kwargs):
            self._comm.Allreduce_init(*args, **kwargs).Free()
            raise NotImplementedError

        def __getattr__(self, name):
            return getattr(self._comm, name)

    comm = Without(COMM) if COMM.rank == COMM.size - 1 else COMM
    assert persistent_collectives(comm) is False
