"""The job scripts' clean-up of MPI shared-memory leftovers (hpctrain/jobs/shm_leftovers.py):
only files named like an MPI segment, owned by this user, made since the launch and held
by no process are removed; a folder stands in for /dev/shm (HPCTRAIN_SHM_DIR)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hpctrain.comm.shm_segments import MPI_SEGMENTS
from hpctrain.comm.shm_segments import remove_leftovers as remove_any
from hpctrain.jobs.shm_leftovers import SHM_DIR_ENV, main
from tests.jobs_common import script


def remove_leftovers(shm, since, uid=None):
    """The job script's rule: any MPI's segment names."""
    return [os.path.basename(p) for p in remove_any(since, str(shm), MPI_SEGMENTS, uid=uid)]


def _file(folder, name, mtime=None):
    path = folder / name
    path.write_bytes(b"\0" * 64)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_only_this_jobs_unused_segments_are_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    since = time.time() - 10
    ours = [_file(shm, "mpich_shm_1b296e84_0"), _file(shm, "vader_segment.node.1a.0"),
            _file(shm, "sm_segment.node.0.2a")]
    older = _file(shm, "mpich_shm_0ld_0", mtime=since - 60)  # before this job's launch
    other_name = _file(shm, "psm2_shm.1234")  # not an MPI segment this rule knows
    held = _file(shm, "mpich_shm_live_0")  # a live job's: a process has it open
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; f = open(sys.argv[1], 'rb'); "
                               "print('open', flush=True); time.sleep(60)", str(held)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "open\n"
        removed = remove_leftovers(shm, since)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert sorted(removed) == sorted(p.name for p in ours)
    assert not any(p.exists() for p in ours)
    assert older.exists() and other_name.exists() and held.exists()
    # Another user's segment is never touched (the rule compares the owner).
    assert remove_leftovers(shm, since, uid=os.getuid() + 1) == []
    assert held.exists()


def test_a_mapped_segment_is_kept(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    mapped = _file(shm, "mpich_shm_mapped_0")
    holder = subprocess.Popen([sys.executable, "-c",
                               "import mmap, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR)\n"
                               "m = mmap.mmap(fd, 64)\nos.close(fd)\n"
                               "print('mapped', flush=True)\ntime.sleep(60)", str(mapped)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "mapped\n"
        assert remove_leftovers(shm, time.time() - 10) == []
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert mapped.exists()


def test_the_command_reads_its_time_from_a_file_and_says_what_it_removed(tmp_path, capsys,
                                                                        monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    since = tmp_path / "job.txt"
    since.write_text("started\n")
    os.utime(since, (time.time() - 5, time.time() - 5))
    _file(shm, "mpich_shm_abc_0")
    monkeypatch.setenv(SHM_DIR_ENV, str(shm))
    assert main([str(since)]) == 0
    assert capsys.readouterr().out == (f"hpctrain job: removed 1 shared-memory file(s) the "
                                       f"ranks left in {shm}: mpich_shm_abc_0\n")
    assert main([str(tmp_path / "missing")]) == 0  # no clean-up, never a failed job
    assert "no shared-memory clean-up" in capsys.readouterr().err


@pytest.mark.parametrize("system", ["slurm", "polaris", "local"])
def test_every_script_cleans_up_after_the_launch_and_before_a_requeued_attempt(system):
    text = script(system)
    end = text.index('echo "$rc" > "$ATTEMPT_DIR/exit_code"')
    assert text.index('-m hpctrain.jobs.shm_leftovers "$ATTEMPT_DIR/job.txt" || true',
                      end) > end
    requeue = text.index('-m hpctrain.jobs.shm_leftovers "$RUN_DIR/jobs/$JOB_TAG/job.txt"')
    assert requeue < text.index('"${LAUNCH[@]}" &')
