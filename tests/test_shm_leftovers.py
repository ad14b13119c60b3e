"""No exit path leaves MPI's shared memory in /dev/shm (issue 39, item 4), at 2 ranks
under this machine's mpiexec: a normal finish, a stop by SIGTERM, the agreed exit 2, an
abort from one rank's error, an uncaught exception, a KeyboardInterrupt (130) and a rank
killed by SIGKILL. Each job is a small script that ends the way hpctrain's commands do
(``hpctrain.comm.abort``'s handler, ``train.stop``'s signal flag) and holds a shared
window as the shared-memory allreduce does. Other jobs run on this machine at the same
time, so a test counts only the entries its own job created: each rank names the /dev/shm
files it maps (before anything unlinks them); none may exist after the job.

Three mechanisms, each tested alone: ``MPI_Finalize`` on the paths that live to call it
(``kept``: the names are not unlinked at start), the names unlinked once every rank has
joined (``comm/shm_segments.py``), which covers the paths that cannot finalize, and the
watcher ``local_mpiexec`` leaves, which removes what a launch left when it ends.
Each job takes under a second; the abort and the kill run in ``make test``, the rest in
the ``slow`` leg.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from hpctrain.comm.shm_segments import MPICH_SEGMENT, leftovers, linked_mappings
from tests.helpers import launcher, mpiexec, run

SCRIPT = r'''
import os, re, signal, sys, time
from mpi4py import MPI
from hpctrain.comm import shm_segments
from hpctrain.comm.resources import MPIResources

path, keep, record = sys.argv[1], sys.argv[2] == "kept", sys.argv[3]
comm = MPI.COMM_WORLD


def note_maps():  # every /dev/shm file this rank maps, one a line
    with open(f"{record}.{comm.rank}", "a") as f:
        f.writelines(p + "\n" for p in shm_segments.own_segments(re.compile(".+")))


def on_finalize(_comm, _key, _value, rank=comm.rank):  # MPI_Finalize frees COMM_SELF's
    # attributes first (MPI 4.0, 11.2.4); mpi4py's own finalize at exit runs after Python's
    # and calls no Python, so this marks only an MPI.Finalize() made from Python
    open(f"{record}-finalized.{rank}", "w").close()
    return MPI.SUCCESS


MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=on_finalize), 1)
note_maps()
if keep:  # MPI_Finalize alone must release the segment
    shm_segments.unlink_segment_names = lambda comm: []
from hpctrain.comm.abort import install_abort_handler
from hpctrain.errors import UserError

install_abort_handler(comm)
resources = MPIResources()  # as the shared-memory allreduce holds its window
resources.add(MPI.Win.Allocate_shared(1 << 16, 1, comm=comm))
note_maps()
comm.Barrier()
if path == "finish":
    sys.exit(0)
if path == "stop":  # the trainer's way: the flag, agreed, then a normal exit
    from hpctrain.train.stop import SignalFlag
    flag = SignalFlag().install()
    os.kill(os.getpid(), signal.SIGTERM)
    while not flag.stopping:
        time.sleep(0.01)
    comm.Barrier()
    flag.restore(ignore=True)
    sys.exit(0)
if path == "exit2":
    raise UserError("every rank sees this")
if path == "exception":
    raise RuntimeError("every rank fails")
if path == "interrupt":
    raise KeyboardInterrupt
if comm.rank == 1:
    if path == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("only rank 1 fails")  # abort
comm.Barrier()  # rank 0 waits here until the job ends
'''

SLOW = pytest.mark.slow  # in make test-slow; abort and kill stand for the unlinked names
CASES = [pytest.param("finish", 0, "unlinked", marks=SLOW),
         pytest.param("stop", 0, "unlinked", marks=SLOW),
         pytest.param("exit2", 2, "unlinked", marks=SLOW),
         ("abort", 1, "unlinked"),
         pytest.param("exception", 1, "unlinked", marks=SLOW),
         pytest.param("interrupt", 130, "unlinked", marks=SLOW),
         ("kill", None, "unlinked"),
         # Without the early unlink only MPI_Finalize releases them. Not on the agreed
         # exit 2: the first rank out of Finalize exits 2, and Hydra then kills the others,
         # the segment's creator too, often before its Finalize unlinks the name.
         pytest.param("finish", 0, "kept", marks=SLOW),
         pytest.param("stop", 0, "kept", marks=SLOW)]


def _job_segments(record: Path) -> set[str]:
    return {line for f in record.parent.glob(record.name + ".*")
            for line in f.read_text().splitlines()}


@pytest.mark.parametrize("path,code,names", CASES)
def test_an_exit_path_leaves_no_shared_memory(tmp_path, path, code, names):
    if launcher().family != "hydra":
        pytest.skip(f"MPICH's segments: the launcher is {launcher().describe()}")
    script = tmp_path / "exit_path.py"
    script.write_text(SCRIPT)
    record = tmp_path / "maps"
    p = run(mpiexec(2, sys.executable, str(script), path, names, str(record)), timeout=60,
            env={"PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode != 0 if code is None else p.returncode == code, p.stderr
    segments = _job_segments(record)
    mpich = {s for s in segments if MPICH_SEGMENT.fullmatch(os.path.basename(s))}
    assert mpich, f"the job mapped no MPICH segment: {segments}"  # else this proves nothing
    left = sorted(s for s in segments if os.path.exists(s))
    assert not left, f"{path}: {len(left)} of the job's {len(segments)} left: {left}"
    if path == "exit2":  # exit_releasing_mpi finalizes MPI on every rank (os._exit alone:
        # the kill race below leaves the name now and then; unlinked at start, never)
        assert sorted(f.name for f in tmp_path.glob("maps-finalized.*")) == \
            ["maps-finalized.0", "maps-finalized.1"]


def test_only_linked_mpich_segments_under_dev_shm_are_named():
    maps = "\n".join([
        "7ff5be9aa000-7ff5bebb0000 rw-s 00000000 00:1b 12249    /dev/shm/mpich_shm_55324f72_0",
        "7ff5be9aa000-7ff5bebb0000 rw-s 00000000 00:1b 12249    /dev/shm/mpich_shm_55324f72_0",
        "7ff5bebf3000-7ff5bebfc000 rw-s 00000000 00:1b 12247    /dev/shm/mpich_shm_1a_1 (deleted)",
        "7ff5bebf3000-7ff5bebfc000 rw-s 00000000 00:1b 12247    /dev/shm/ucx_shm_posix_600ce6d9",
        "7ff5bec05000-7ff5bf01e000 rw-s 00000000 00:1b 12246    /tmp/mpich_shm_2b_0",
        "7ff5bec05000-7ff5bf01e000 rw-p 00000000 00:00 0",
        "7ff5bec05000-7ff5bf01e000 rw-s 00000000 00:1b 12246    /dev/shm/mpich_shm_2b_0x",
        "7ff5bec05000-7ff5bf01e000 rw-s 00000000 00:1b 12246    /dev/shm/mpich_shm_3c_12",
    ])
    assert linked_mappings(maps) == ["/dev/shm/mpich_shm_55324f72_0", "/dev/shm/mpich_shm_3c_12"]
    everything = linked_mappings(maps, re.compile(".+"))
    assert "/dev/shm/ucx_shm_posix_600ce6d9" in everything
    assert not any("deleted" in p or p.startswith("/tmp") for p in everything)


def test_a_launch_through_local_mpiexec_removes_what_its_aborted_ranks_left(tmp_path):
    """The ranks keep the names (as a program that never unlinks them would) and abort;
    the watcher the launcher left removes the segment once the launch has ended."""
    if launcher().family != "hydra":
        pytest.skip(f"MPICH's segments: the launcher is {launcher().describe()}")
    script, record = tmp_path / "exit_path.py", tmp_path / "maps"
    script.write_text(SCRIPT)
    p = run([sys.executable, "-m", "hpctrain.comm.local_mpiexec", "-n", "2", sys.executable,
             str(script), "abort", "kept", str(record)], timeout=60,
            env={"PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 1, p.stderr
    mpich = {s for s in _job_segments(record) if MPICH_SEGMENT.fullmatch(os.path.basename(s))}
    assert mpich
    for _ in range(300):  # the watcher runs once the launch has ended: a bounded wait
        if not any(os.path.exists(s) for s in mpich):
            break
        time.sleep(0.05)
    assert not [s for s in mpich if os.path.exists(s)]


def test_a_leftover_is_this_users_new_segment_that_no_live_process_holds(tmp_path):
    since = time.time() - 1.0
    for name in ("mpich_shm_ab_0", "mpich_shm_cd_0", "ucx_shm_posix_ef", "mpich_shm_12_3x"):
        (tmp_path / name).write_bytes(b"\0" * 64)
    with open(tmp_path / "mpich_shm_cd_0", "rb"):  # a live job holds its segment open
        assert leftovers(since, str(tmp_path)) == [str(tmp_path / "mpich_shm_ab_0")]
    assert leftovers(since, str(tmp_path)) == [str(tmp_path / f"mpich_shm_{n}_0")
                                               for n in ("ab", "cd")]
    assert leftovers(time.time() + 60, str(tmp_path)) == []  # none made since the launch
