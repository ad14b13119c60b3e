"""The trainer's own deadline (``--train.time_limit``, ``$SLURM_JOB_END_TIME``): pure
parts, without MPI. The end-to-end test under ``mpiexec`` is in test_failures.py."""

import time

import pytest

from hpctrain.train.deadline import JOB_START_ENV, SLURM_END_ENV, Deadline, process_start_time
from hpctrain.train.stop import SignalFlag


def test_no_limit_no_deadline():
    d = Deadline.from_config(0, env={})
    assert d.end is None and not d.passed()


def test_the_limit_counts_from_the_job_start_and_slurm_end_wins_when_earlier():
    d = Deadline.from_config(100, env={JOB_START_ENV: "1000"})
    assert d.end == 1100
    d = Deadline.from_config(100, env={JOB_START_ENV: "1000", SLURM_END_ENV: "1050"})
    assert d.end == 1050
    d = Deadline.from_config(0, env={SLURM_END_ENV: "1050"})
    assert d.end == 1050
    d = Deadline.from_config(100, env={JOB_START_ENV: "not a number"})
    assert d.end == pytest.approx(process_start_time() + 100)


def test_the_process_start_is_when_the_process_started():
    """A child started between two readings of the clock says it started between them
    (within the second /proc's boot time is rounded to)."""
    import subprocess
    import sys

    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from hpctrain.train.deadline import "
                          "process_start_time as t; print(t())"],
                         capture_output=True, text=True, timeout=60, check=True)
    after = time.time()
    started = float(out.stdout)
    assert before - 1.0 <= started <= after + 1.0


def test_the_margin_grows_with_the_measured_save_and_steps():
    d = Deadline(end=1000.0, limit_s=200)
    assert d.margin == pytest.approx(10)  # 5% of the limit
    d.record_save(3.0)
    d.record_save(2.0)  # the longest save counts
    d.record_step(0.5)
    assert d.margin == pytest.approx(10 + 2 * 3.0 + 2 * 0.5)
    assert not d.passed(now=1000 - 17.1) and d.passed(now=1000 - 16.9)
    assert Deadline(end=None, limit_s=10 ** 6).base == 60  # at most a minute


def test_the_margin_leaves_the_shutdown_the_start_up_took():
    """After the last save the processes still have to leave (MPI's finalize, the
    interpreter's exit); the start-up's length stands in for it, as slow as the node."""
    d = Deadline(end=1000.0, limit_s=200)
    d.record_save(3.0)
    d.record_startup(started=500.0, now=507.5)
    assert d.shutdown == pytest.approx(7.5)
    assert d.margin == pytest.approx(10 + 2 * 3.0 + 7.5)
    assert "shutdown 7.5 s" in d.describe()


def test_a_passed_deadline_trips_the_stop_flag_once():
    flag = SignalFlag()
    flag.trip("the time limit")
    flag.trip("something else")
    assert flag.stopping and flag.name == "the time limit" and flag.received is None
