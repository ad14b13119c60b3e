"""A launcher of one MPI starting mpi4py on the other is one line and exit 2 before MPI
starts (MPICH's own start-up under Open MPI's mpirun aborts with 'unsupported PMI version
PMIx'). The real launches (`slow`) need both MPIs: they run in make test-openmpi, where
Debian's Open MPI and its mpi4py environment sit beside the MPICH wheel's."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpctrain.comm.world_check import WrongLauncher, check_library_matches_launcher

ROOT = Path(__file__).resolve().parents[1]
MPICH_PY, OMPI_PY = ROOT / ".venv" / "bin" / "python", ROOT / ".venv-openmpi" / "bin" / "python"
OPEN_MPI_RUN = shutil.which("mpirun.openmpi")
HYDRA = ROOT / ".venv" / "bin" / "mpiexec"
OPEN_MPI_ENV = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0"}
HYDRA_ENV = {"PMI_SIZE": "2", "PMI_RANK": "0", "PMI_FD": "9", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize("env,family,launcher", [(OPEN_MPI_ENV, "mpich", "Open MPI"),
                                                 (HYDRA_ENV, "openmpi", "MPICH")])
def test_a_launcher_of_the_other_mpi_is_named_with_the_fix(env, family, launcher):
    with pytest.raises(WrongLauncher, match=f"^{launcher}'s launcher started this process.*"
                                            "launch with .*or build mpi4py against"):
        check_library_matches_launcher(env, family)


@pytest.mark.parametrize("env,family", [
    (OPEN_MPI_ENV, "openmpi"), (HYDRA_ENV, "mpich"), ({}, "mpich"), ({}, "openmpi"),
    (OPEN_MPI_ENV, None),  # a library mpi4py could not classify: MPI's start-up decides
    ({**HYDRA_ENV, "SLURM_STEP_ID": "0"}, "openmpi"),  # srun's PMI: its plugin decides
    ({**HYDRA_ENV, "PMIX_RANK": "0"}, "openmpi"),  # PMIx (PALS --pmi=pmix, srun pmix)
])
def test_matching_or_unknown_launchers_pass(env, family, monkeypatch):
    monkeypatch.setattr("hpctrain.comm.world_check.mpi4py_library_family", lambda: None)
    check_library_matches_launcher(env, family)


def _launch(launcher: list[str], python: Path, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return subprocess.run([*launcher, "-n", "2", str(python), "-m", "hpctrain", "train",
                           "default", "--train.max_iters=1", f"--train.out_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def _assert_one_line_exit_2(out, launcher: str, tmp_path) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert text.count(f"error: {launcher}'s launcher started this process") == 1, text
    assert "unsupported PMI version" not in text and "Traceback" not in text
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.slow
@pytest.mark.skipif(not (OPEN_MPI_RUN and MPICH_PY.exists()),
                    reason="needs Open MPI's mpirun beside the MPICH wheel's environment "
                           "(make test-openmpi)")
def test_open_mpis_mpirun_starting_the_mpich_wheel_is_one_line_and_exit_2(tmp_path):
    out = _launch([OPEN_MPI_RUN, "--oversubscribe"], MPICH_PY, tmp_path)
    _assert_one_line_exit_2(out, "Open MPI", tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(not (HYDRA.exists() and OMPI_PY.exists()),
                    reason="needs the Open MPI mpi4py environment .venv-openmpi beside the "
                           "MPICH wheel's mpiexec (make test-openmpi)")
def test_hydra_starting_an_open_mpi_mpi4py_is_one_line_and_exit_2(tmp_path):
    out = _launch([str(HYDRA)], OMPI_PY, tmp_path)
    _assert_one_line_exit_2(out, "MPICH", tmp_path)
