"""The out_dir lock when many runs start at once (issue 29, item 7): exactly one holds it,
whether the directory has no lock or a stale one (its holder dead) that they all race
to take over. Before the takeover under a guard, a starter deleted whatever lock file
was there, possibly one another starter had just created: both held the lock in 8 of
200 trials."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from hpctrain.train import rundir_lock
from hpctrain.train.rundir_lock import LOCK_NAME, RunDirError, RunDirLock

STARTERS = 8
TRIALS = 200


def _dead_pid() -> int:
    """The PID of a process of this host that has ended."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    return int(p.stdout)


def _starter(out_dir, barrier, held, index, no_links):
    """One starter per trial: all try at once; the holder lets go after the count.
    Reading the lock takes a random 0-1 ms, as on a networked file system: it widens
    the windows in which starters overtake each other."""
    read = RunDirLock._read

    def slow_read(self):
        time.sleep(random.random() * 1e-3)
        return read(self)

    RunDirLock._read = slow_read
    if no_links:
        def no_link(*args):
            raise PermissionError(1, "Operation not permitted")
        os.link = no_link
    for _ in range(TRIALS):
        barrier.wait()
        lock = RunDirLock(out_dir)
        try:
            lock.acquire()
        except RunDirError:
            pass
        held[index] = int(lock.held)
        barrier.wait()  # every starter has tried: the parent counts
        barrier.wait()
        lock.release()
        barrier.wait()  # released: the parent sets up the next trial


@pytest.mark.slow  # starts processes
@pytest.mark.parametrize("no_links", [False, True], ids=["link", "exclusive-create"])
def test_many_starters_on_one_out_dir_exactly_one_holds_the_lock(tmp_path, no_links):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(STARTERS + 1, timeout=60)
    held = ctx.Array("i", STARTERS)
    workers = [ctx.Process(target=_starter, args=(tmp_path, barrier, held, i, no_links))
               for i in range(STARTERS)]
    for w in workers:
        w.start()
    stale = {"host": socket.gethostname(), "pid": _dead_pid(), "job": None,
             "started": "2026-11-24T00:00:00Z"}
    counts = []
    try:
        for trial in range(TRIALS):
            if trial % 2:  # a lock of a killed job, which every starter may take over
                (tmp_path / LOCK_NAME).write_text(json.dumps(stale))
            barrier.wait()
            barrier.wait()
            counts.append(sum(held))
            holder = json.loads((tmp_path / LOCK_NAME).read_text())
            assert holder["pid"] in [w.pid for w in workers], holder
            barrier.wait()
            barrier.wait()
            assert not (tmp_path / LOCK_NAME).exists()
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    assert counts == [1] * TRIALS, f"{sum(c != 1 for c in counts)} of {TRIALS} trials " \
                                   f"had another number of holders: {counts}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no guard, no record left


def test_a_guard_left_by_a_killed_takeover_is_named_not_guessed(tmp_path, monkeypatch):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": _dead_pid(), "started": "?"}))
    guard = tmp_path / (LOCK_NAME + rundir_lock.GUARD_SUFFIX)
    guard.write_text("{}")
    os.utime(guard, (0, 0))
    with pytest.raises(RunDirError, match=r"was left by a run killed while it took over"):
        RunDirLock(tmp_path).acquire()
    assert guard.exists() and (tmp_path / LOCK_NAME).exists()  # nothing guessed at


def test_a_stale_lock_is_replaced_whole_and_named_in_the_log(tmp_path):
    dead = _dead_pid()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": dead, "started": "then"}))
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert lock.took_over["pid"] == dead
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert list(tmp_path.iterdir()) == []


def test_a_takeover_overtaken_by_another_starter_leaves_the_new_holder(tmp_path, monkeypatch):
    """Starter A judges the lock stale; before A replaces it, starter B (another live
    process, here our parent) takes it over. A must find the lock changed (read again under the guard) and leave B holding it:
    the race the slow many-starters test provokes, played in order in one process."""
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": _dead_pid(), "started": "then"}))
    a, b = RunDirLock(tmp_path), RunDirLock(tmp_path)
    take_over, record = RunDirLock._take_over, rundir_lock.holder_record

    def overtaken(self, stale, mine):
        if self is a and not b.held:
            with monkeypatch.context() as m:
                m.setattr(rundir_lock, "holder_record",
                          lambda: {**record(), "pid": os.getppid(), "job": "B"})
                b.acquire()
        return take_over(self, stale, mine)

    monkeypatch.setattr(RunDirLock, "_take_over", overtaken)
    with pytest.raises(RunDirError, match="in use by another run"):
        a.acquire()
    assert b.held and not a.held
    assert json.loads((tmp_path / LOCK_NAME).read_text())["job"] == "B"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no guard, no record



def test_a_lock_held_by_an_unreaped_dead_process_is_stale(tmp_path):
    """A rank killed under a container's init that reaps nothing stays a zombie: it
    exists for kill(0) but holds nothing, so its lock is taken over (a requeued attempt
    was refused as 'in use by another run')."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(600):  # until it has exited, unreaped (bounded)
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    try:
        mine = rundir_lock.holder_record()
        assert rundir_lock.is_stale({**mine, "pid": child.pid}, mine)
        assert not rundir_lock.is_stale({**mine, "pid": os.getppid()}, mine)  # alive
    finally:
        child.wait(timeout=30)
