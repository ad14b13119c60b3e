"""The registry the tensor-parallel operators find their group in."""

import gc

from mpi4py import MPI

from hpctrain.parallel.tensor.group import GROUPS, TensorParallelGroup
from tests.helpers import cpu_world


def test_a_group_lives_as_long_as_its_users_and_its_number_is_never_reused():
    world = cpu_world(MPI.COMM_SELF)
    group = TensorParallelGroup(MPI.COMM_SELF, world)
    first = group.key
    assert GROUPS[first] is group
    del group
    gc.collect()
    assert first not in GROUPS
    assert TensorParallelGroup(MPI.COMM_SELF, world).key != first
