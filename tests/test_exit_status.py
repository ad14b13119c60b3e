"""Exit statuses that survive the launcher (issue 29, item 2), at 2 ranks under this
machine's mpiexec: a user error that every rank raises ends with status 2 without
``MPI_Abort`` (under ``srun`` an abort is recorded as 137, tests/test_slurm_real.py); one
that only one rank raises still ends the job at once, through the abort."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import hpctrain_cmd, mpiexec, run

pytestmark = pytest.mark.slow  # each starts a job under mpiexec (make test-slow)


def test_a_user_error_every_rank_raises_exits_2_without_mpi_abort(tmp_path):
    p = run(mpiexec(2, *hpctrain_cmd("train", "default", f"--data.path={tmp_path}/x.h5",
                                     f"--train.out_dir={tmp_path}/out", "--parallel.pp=3")),
            timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("error: 2 rank(s) cannot form pipelines"), \
        p.stderr  # once, for the job, not once per rank
    assert "mpi_abort" not in p.stderr.lower(), p.stderr  # Hydra's and Open MPI's words
    # That it finalizes MPI and leaves nothing in /dev/shm, counted per job while other
    # jobs share the node: tests/test_shm_leftovers.py.


def test_a_user_error_on_one_rank_only_ends_the_job_through_the_abort(tmp_path):
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import sys\n"
        "from hpctrain.errors import UserError\n"
        "from hpctrain.train.trainer import Trainer\n"
        "build = Trainer._build\n"
        "def failing(self, cfg, world):\n"
        "    if world.rank == 1:\n"
        "        raise UserError('only rank 1 sees this')\n"
        "    return build(self, cfg, world)\n"
        "Trainer._build = failing\n"
        "from hpctrain.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    dataset = tmp_path / "tiny.h5"
    from tests.helpers import make_dataset

    make_dataset(dataset, max_bytes=20_000)
    p = run(mpiexec(2, sys.executable, str(script), "train", "default",
                    f"--data.path={dataset}", f"--train.out_dir={tmp_path}/out",
                    "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2",
                    "--model.block_size=16", "--train.batch_size=4", "--comm.timeout=60"),
            timeout=120)
    assert p.returncode == 2, p.stderr  # Hydra and Open MPI pass the abort's code on
    assert "[rank 1/2] error: only rank 1 sees this" in p.stderr, p.stderr
    # Rank 0 waits in a collective; rank 1 waits AGREE_S (comm/abort.py) for agreement,
    # then aborts (a job that hung instead would run into run()'s limit: a failure).
