"""Nothing MPI is left behind: every communicator, window, persistent request and file a
trainer makes is freed by ``close()``, whatever the layout, over many create/close
cycles in one process (``hpctrain/comm/resources.py``)."""

import pytest
from mpi4py import MPI

from hpctrain.comm.grid import ProcessGrid
from hpctrain.comm.resources import MPIResources
from hpctrain.train.trainer import Trainer
from tests.helpers import cpu_world, tiny_config, two_ranks_suffice

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD

LAYOUTS = [
    {"comm.transport": "shm"},  # the shared window and its communicators
    {"comm.transport": "mpi"},  # persistent requests (MPI-4) or none
    {"parallel.zero": 3},  # ZeRO-3's gather communicator
    {"parallel.pp": 2, "parallel.micro_batches": 2},  # the grid's communicators
    {"parallel.ep": 2, "model.moe_experts": 2},  # expert groups, the dispatch's row types
]


@pytest.fixture
def recorded(monkeypatch):
    """Every MPI object handed to any ``MPIResources`` while the test runs."""
    objects = []
    add = MPIResources.add

    def recording_add(self, obj, free=None):
        objects.append(obj)
        return add(self, obj, free)

    monkeypatch.setattr(MPIResources, "add", recording_add)
    return objects


def test_trainers_of_every_layout_leave_nothing_behind(mpi_dataset, shared_tmp, recorded):
    """Five trainers of each layout, one after another (a leak that only shows once a
    cache is reused shows from the second); how many communicators a leak would use up
    is the next test's business."""
    world = cpu_world(COMM)
    for i in range(5 * len(LAYOUTS)):
        layout = LAYOUTS[i % len(LAYOUTS)]
        if layout.get("parallel.pp", 1) > COMM.size:
            continue
        trainer = Trainer(tiny_config(mpi_dataset, f"{shared_tmp}/c{i}", **layout), world,
                          verbose=False)
        trainer.close()
    world.close()
    kinds = {type(o).__name__ for o in recorded}
    assert {"Intracomm", "Win", "File"} <= kinds  # the layouts made what they should
    alive = [repr(o) for o in recorded if o]
    assert not alive, f"{len(alive)} MPI object(s) left after close(): {alive[:5]}"


@two_ranks_suffice("a leaked communicator is each process's own; two ranks make the "
                   "same splits of a two-stage grid")
def test_grids_do_not_use_up_communicators():
    """MPICH has room for about 2,000 communicators per process: 3,000 grids of two
    split communicators each fail with 'too many communicators' if close() leaks."""
    world = cpu_world(COMM)
    for _ in range(3000):
        ProcessGrid.create(world, 2 if COMM.size % 2 == 0 else 1).close()
    world.close()


def test_close_is_idempotent_and_frees_newest_first():
    order = []
    res = MPIResources()
    a = res.add(COMM.Dup(), lambda: order.append("a"))
    b = res.add(COMM.Dup(), lambda: order.append("b"))
    assert res.held == 2
    res.close()
    res.close()
    assert order == ["b", "a"] and res.held == 0
    a.Free()
    b.Free()
