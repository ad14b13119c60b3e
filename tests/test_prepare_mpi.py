"""``prepare`` over real MPI ranks (under ``mpiexec -n 2`` and ``-n 4``): the published
file's mode follows the umask as it does on one process, and an existing output is
refused on every rank with nothing on disk changed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from mpi4py import MPI

from hpctrain.comm.small_collectives import allgather_json
from hpctrain.data.prepare import prepare
from hpctrain.errors import DataError

pytestmark = pytest.mark.mpi(min_size=2)
COMM = MPI.COMM_WORLD


@pytest.fixture
def corpus(shared_tmp):
    """Text files every rank sees, more of them than ranks."""
    folder = Path(shared_tmp) / "corpus"
    if COMM.rank == 0:
        folder.mkdir()
        for i in range(2 * COMM.size):
            (folder / f"{i:02d}.txt").write_text(f"text {i}: " + "no play " * (40 * i + 1))
    COMM.Barrier()
    return folder


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)],
                         ids=["umask022", "umask027"])
def test_parallel_prepare_gives_the_mode_open_would_give_like_one_process(corpus, mask, mode):
    old = os.umask(mask)  # on every rank: whichever creates or renames, the mode is the same
    try:
        out = Path(prepare([corpus], corpus.parent / "par.h5", show_progress=False,
                           comm=COMM)["output"])
        if COMM.rank == 0:
            one = Path(prepare([corpus], corpus.parent / "one.h5", show_progress=False)["output"])
            assert stat.S_IMODE(out.stat().st_mode) == stat.S_IMODE(one.stat().st_mode) == mode
            assert out.read_bytes() == one.read_bytes()
    finally:
        os.umask(old)
    COMM.Barrier()


def test_parallel_prepare_refuses_an_existing_output_on_every_rank(corpus):
    out = corpus.parent / "d.h5"
    prepare([corpus], out, show_progress=False, comm=COMM)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in corpus.parent.iterdir()}
    with pytest.raises(DataError, match=r"d.h5 exists; add --overwrite to replace it"):
        prepare([corpus], out, show_progress=False, comm=COMM)
    COMM.Barrier()
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in corpus.parent.iterdir()}
    assert after == before
    prepare([corpus], out, show_progress=False, comm=COMM, overwrite=True)


def test_allgather_json_gives_every_rank_every_object():
    got = allgather_json(COMM, {"rank": COMM.rank, "text": "é" * COMM.rank}, timeout=30,
                         what="test allgather")
    assert got == [{"rank": r, "text": "é" * r} for r in range(COMM.size)]
