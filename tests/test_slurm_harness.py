"""The Slurm harness's teardown leaves nothing running that its cluster started."""

import os
import subprocess
import sys

from tests.slurm_harness import kill_leftovers, processes_under


def _sleeper(conf):
    env = {**os.environ, "SLURM_CONF": str(conf)}
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)


def test_teardown_kills_what_runs_under_this_cluster_and_nothing_else(tmp_path):
    ours, other = _sleeper(tmp_path / "slurm.conf"), _sleeper(tmp_path / "other.conf")
    try:
        assert processes_under(tmp_path / "slurm.conf") == [ours.pid]
        assert kill_leftovers(tmp_path / "slurm.conf") == 1
        assert ours.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()
