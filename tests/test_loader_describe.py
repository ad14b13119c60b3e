"""The batch loader describes itself for the start-up log (``BatchLoader.describe``):
the reader, and why reads stay in the main thread when prefetching was asked for."""

import pytest
from mpi4py import MPI

from hpctrain.comm.world import THREAD_LEVEL_HINT
from hpctrain.data.loader import BatchLoader, thread_note
from hpctrain.data.mpiio import describe_reader
from tests.helpers import cpu_world, tiny_config


def test_the_thread_note_says_why_a_prefetch_asked_for_reads_in_the_main_thread():
    note = thread_note(True, False, MPI.THREAD_FUNNELED)
    assert note.startswith("; read in the main thread") and "level funneled" in note
    assert note.endswith(f"({THREAD_LEVEL_HINT})")
    assert thread_note(True, True, MPI.THREAD_FUNNELED) == ""  # the thread reads ahead
    assert thread_note(False, False, MPI.THREAD_FUNNELED) == ""  # none asked for


def _open(dataset_path, out_dir, prefetch: bool) -> BatchLoader:
    world = cpu_world(MPI.COMM_SELF)
    cfg = tiny_config(dataset_path, out_dir, **{"data.reader": "mpiio",
                                                "data.prefetch": prefetch})
    return BatchLoader.open(cfg, world, dp_index=0, dp=1, device=world.accel)


def test_the_loader_describes_its_reader_and_why_it_reads_in_the_main_thread(
        dataset_path, tmp_path, monkeypatch):
    # MPI initialized with less than MULTIPLE: the MPI-IO reader gets no thread.
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    for prefetch in (True, False):
        loader = _open(dataset_path, tmp_path, prefetch)
        try:
            assert not loader.data.threaded
            text = loader.describe()
            assert text.startswith(describe_reader(loader.data.reader))
            assert text.endswith(thread_note(True, False, MPI.THREAD_SERIALIZED)) is prefetch
            assert ("level serialized" in text) is prefetch
        finally:
            loader.close()


def test_a_loader_that_reads_ahead_says_only_what_reads(dataset_path, tmp_path):
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("MPI below MULTIPLE here: no thread for an MPI-IO reader")
    loader = _open(dataset_path, tmp_path, prefetch=True)
    try:
        assert loader.data.threaded
        assert loader.describe() == describe_reader(loader.data.reader)
    finally:
        loader.close()
