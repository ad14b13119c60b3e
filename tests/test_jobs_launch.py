"""The launch line without MPI: `hpctrain launch` planning and the allocation it reads,
device binding before MPI starts, srun's MPI plugin."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR, JobError
from hpctrain.jobs import bind, launch_line
from hpctrain.jobs.job_system import job_system
from hpctrain.jobs.spec import build_spec
from tests.jobs_common import CLUSTERS, CMD, REPO, launch_block, script


# ----------------------------------------------------------------------- launch line

def test_launch_plan_matches_the_script_for_the_same_allocation(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1\nx1\nx2\nx2\nx3\n")  # one line per rank slot: 3 unique hosts
    alloc = launch_line.detect_allocation({"PBS_JOBID": "9.pbs", "PBS_NODEFILE": str(nodefile)})
    assert (alloc.scheduler, alloc.nodes) == ("pbs", 3)
    command = CMD + ["--train.resume=auto", "--train.out_dir=/r"]
    argv = launch_line.plan_launch(job_system("polaris"), alloc, command, python="/py")
    assert argv[:3] == ["mpiexec", "-n", "12"]
    # The script's LAUNCH array, with its variables given the same values, is this argv.
    words = launch_block(script("polaris"))
    values = {"${NRANKS}": "12", "${PYTHON}": "/py", "${RUN_DIR}": "/r"}
    resolved = [values.get(w, w).replace("${RUN_DIR}", "/r") for w in words]
    assert resolved == argv


def test_detect_allocation_for_slurm_and_none():
    a = launch_line.detect_allocation({"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "4"})
    assert (a.scheduler, a.nodes, a.job_id) == ("slurm", 4, "5")
    assert launch_line.detect_allocation({"SLURM_JOBID": "5", "SLURM_NNODES": "2"}).nodes == 2
    assert launch_line.detect_allocation({}).scheduler == "none"
    with pytest.raises(JobError, match="PBS_NODEFILE"):
        launch_line.detect_allocation({"PBS_JOBID": "1", "PBS_NODEFILE": "/nonexistent"})
    with pytest.raises(JobError, match="node count"):
        launch_line.detect_allocation({"SLURM_JOB_ID": "5"})


def test_plan_launch_local_and_guards():
    local = job_system("local")
    argv = launch_line.plan_launch(local, launch_line.Allocation("none", 1, None, None), CMD,
                                   ranks=3, python=sys.executable)
    assert argv[1:3] == ["-n", "3"] and argv[3:] == [sys.executable, "-m", "hpctrain", *CMD]
    default = launch_line.plan_launch(local, launch_line.Allocation("none", 1, None, None), CMD)
    assert default[2] == str(launch_line.local_ranks())
    with pytest.raises(JobError, match="not in a PBS job"):
        launch_line.plan_launch(job_system("polaris"),
                                launch_line.Allocation("none", 1, None, None), CMD)
    with pytest.raises(JobError, match="--ranks is for the local system"):
        launch_line.plan_launch(job_system("slurm"),
                                launch_line.Allocation("slurm", 2, "1", None), CMD, ranks=4)
    srun = launch_line.plan_launch(job_system("frontier"),
                                   launch_line.Allocation("slurm", 3, "1", None), CMD, python="py")
    assert srun[:4] == ["srun", "-N3", "-n24", "-c7"]


def test_launch_cli_dry_run_and_exit_code(tmp_path, monkeypatch, capsys):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("h1\nh2\n")
    shim = tmp_path / "bin" / "mpiexec"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\nprintf '%s ' \"$@\" > \"$(dirname \"$0\")/argv\"\nexit 7\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:/usr/bin:/bin")
    monkeypatch.setenv("PBS_JOBID", "12.server")
    monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("HPCTRAIN_SYSTEM", "polaris")
    assert main(["launch", "--dry-run", "--", *CMD]) == 0
    out = capsys.readouterr().out
    assert out.startswith("+ mpiexec -n 8 --ppn 4 --depth=8 --cpu-bind depth ")
    assert not (shim.parent / "argv").exists()
    assert main(["launch", "--", *CMD]) == 7  # the launcher's status comes back
    assert (shim.parent / "argv").read_text().startswith("-n 8 --ppn 4")
    assert main(["launch", "--", "train", "default", "--bad"]) == EXIT_USER_ERROR
    assert "unexpected argument '--bad'" in capsys.readouterr().err


# ----------------------------------------------------------------------- bind helper

def test_device_index_rules():
    assert [bind.device_index(r, 4, "reverse") for r in range(8)] == [3, 2, 1, 0, 3, 2, 1, 0]
    assert [bind.device_index(r, 12, "direct") for r in (0, 11, 12)] == [0, 11, 0]
    assert bind.local_rank({"PALS_LOCAL_RANKID": "5", "MPI_LOCALRANKID": "1"}) == 5
    assert bind.local_rank({"SLURM_LOCALID": "2"}) == 2 and bind.local_rank({}) is None


def test_bind_sets_the_device_before_running_the_rank():
    code = "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"
    env = {"PATH": "/usr/bin:/bin", "PALS_LOCAL_RANKID": "1"}
    p = subprocess.run([sys.executable, "-m", "hpctrain.jobs.bind", "--device-env",
                        "CUDA_VISIBLE_DEVICES", "--devices", "4", "--order", "reverse", "--",
                        sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=30, env=env, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip() == "2", p.stderr
    p = subprocess.run([sys.executable, "-m", "hpctrain.jobs.bind", "--device-env", "X",
                        "--devices", "4", "--", "true"], capture_output=True, text=True,
                       timeout=30, env={"PATH": "/usr/bin:/bin"}, cwd=REPO)
    assert p.returncode == 2 and "no local rank" in p.stderr


# ---------------------------------------------------------- srun's MPI plugin (issue A)

SLURM_22_05_LIST = ("MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\n"
                    "specific pmix plugin versions available: pmix_v4\n")
MPICH_WHEEL = ("MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\n"
               "MPICH configure:    --with-device=ch4:ucx,ofi --with-pm=hydra:gforker\n")


def test_generic_slurm_script_passes_an_mpi_plugin_to_srun():
    text = script("slurm")
    assert launch_block(text)[:5] == ["srun", "--mpi=${SRUN_MPI}", "-n", "${NRANKS}",
                                      "--ntasks-per-node=4"]
    assert 'SRUN_MPI=$("$PYTHON" -m hpctrain.jobs.srun_mpi) ||' in text
    fixed = script("slurm", srun_mpi="pmi2")
    assert launch_block(fixed)[:2] == ["srun", "--mpi=pmi2"] and "SRUN_MPI=" not in fixed
    argv = build_spec(system="slurm", command=CMD, walltime="01:00:00", srun_mpi="pmix").argv()
    assert argv[argv.index("--srun-mpi") + 1] == "pmix"  # the script's recorded command
    # The named sites' srun lines keep their site default (cray_shasta on HPE Slingshot).
    assert not any(w.startswith("--mpi") for w in launch_block(script("perlmutter")))
    with pytest.raises(JobError, match="launcher of polaris .mpiexec. has no --mpi="):
        build_spec(system="polaris", command=CMD, srun_mpi="pmi2", **CLUSTERS["polaris"])
    with pytest.raises(JobError, match="not an srun MPI plugin name"):
        build_spec(system="slurm", command=CMD, walltime="01:00:00", srun_mpi="pmi2; rm")


def test_srun_mpi_follows_the_mpi_library_among_the_offered_plugins():
    from hpctrain.jobs.srun_mpi import choose, offered

    listed = offered(SLURM_22_05_LIST)
    assert listed == ["pmix", "none", "cray_shasta", "pmi2"]
    assert offered("srun: MPI types are...\nsrun: none\nsrun: pmix\n") == ["none", "pmix"]
    # The pip mpich wheel has no PMIx client ("unsupported PMI version PMIx"): pmi2,
    # although pmix is listed first.
    assert choose(listed, MPICH_WHEEL)[0] == "pmi2"
    assert choose(listed, MPICH_WHEEL.replace("hydra:gforker", "hydra --with-pmix=/usr"))[0] \
        == "pmix"
    assert choose(listed, "Open MPI v5.0.3, package: Open MPI ...")[0] == "pmix"
    assert choose(listed, "MPI VERSION    : CRAY MPICH version 8.1.28")[0] == "cray_shasta"
    assert choose(listed, None)[0] == "pmix"  # library unknown: pmix where offered
    assert choose(["none", "pmi2"], None)[0] == "pmi2"  # ... else pmi2
    plugin, reason = choose(["none"], "Open MPI v5")
    assert plugin == "pmix" and "offers none of pmix" in reason


def test_srun_mpi_module_prints_the_choice(tmp_path):
    fake = tmp_path / "srun"
    fake.write_text(f"#!/bin/sh\nprintf '{SLURM_22_05_LIST}'\n".replace("\t", "\\t"))
    fake.chmod(0o755)
    p = subprocess.run([sys.executable, "-m", "hpctrain.jobs.srun_mpi"], capture_output=True,
                       text=True, timeout=60, cwd=REPO,
                       env={"PATH": f"{tmp_path}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "pmi2" and "srun --mpi=pmi2 (MPICH" in p.stderr


# ------------------------------------------------- hpctrain launch reads the allocation

@pytest.mark.parametrize("env, expect", [
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"}, ["-n", "2", "--ntasks-per-node=2"]),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "3"}, ["-n", "3", "--ntasks-per-node=2"]),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"},
     ["-n", "8", "--ntasks-per-node=4"]),
    ({"SLURM_JOB_NUM_NODES": "2"}, ["-n", "2", "--ntasks-per-node=1"]),  # no tasks asked
])
def test_launch_takes_the_rank_count_of_a_slurm_allocation(env, expect):
    alloc = launch_line.detect_allocation({"SLURM_JOB_ID": "9", **env})
    argv = launch_line.plan_launch(job_system("slurm"), alloc, CMD, python="py", srun_mpi="pmi2")
    assert argv[:5] == ["srun", "--mpi=pmi2", *expect]


def test_an_allocation_with_more_tasks_than_gpus_names_the_allocation_not_a_flag():
    alloc = launch_line.detect_allocation({"SLURM_JOB_ID": "9", "SLURM_JOB_NUM_NODES": "1",
                                           "SLURM_NTASKS": "16"})
    with pytest.raises(JobError, match=r"the allocation's 16 tasks per node \(16 on 1 node"
                                       r"\(s\)\): a frontier node takes at most 8 ranks.*ask "
                                       r"the allocation for 8 tasks per node or fewer"):
        launch_line.plan_launch(job_system("frontier"), alloc, CMD, python="py")
    with pytest.raises(JobError, match=r"^--ranks-per-node 9: .*use --ranks-per-node 8"):
        launch_line.plan_launch(job_system("frontier"), alloc, CMD, python="py", ranks_per_node=9)


def test_launch_takes_the_rank_slots_of_a_pbs_nodefile(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("h1\nh1\nh1\nh2\nh2\nh2\n")  # select=2:mpiprocs=3
    alloc = launch_line.detect_allocation({"PBS_JOBID": "1.s", "PBS_NODEFILE": str(nodefile)})
    assert (alloc.nodes, alloc.ranks, alloc.ranks_per_node) == (2, 6, 3)
    assert launch_line.plan_launch(job_system("pbs"), alloc, CMD, python="py")[:5] == \
        ["mpiexec", "-n", "6", "-ppn", "3"]
    # --ranks-per-node and --nodes are explicit: they win over the allocation.
    assert launch_line.plan_launch(job_system("pbs"), alloc, CMD, python="py",
                                   ranks_per_node=2)[:5] == ["mpiexec", "-n", "4", "-ppn", "2"]
    nodefile.write_text("h1\nh2\n")  # one line per host: the system decides
    alloc = launch_line.detect_allocation({"PBS_JOBID": "1.s", "PBS_NODEFILE": str(nodefile)})
    assert alloc.ranks is None
    assert launch_line.plan_launch(job_system("polaris"), alloc, CMD, python="py")[:3] == \
        ["mpiexec", "-n", "8"]


def test_launch_dry_run_inside_salloc_uses_the_allocations_ranks(tmp_path, monkeypatch,
                                                                  capsys):
    fake = tmp_path / "srun"
    fake.write_text(f"#!/bin/sh\nprintf '{SLURM_22_05_LIST}'\n".replace("\t", "\\t"))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    for k in ("PBS_JOBID", "HPCTRAIN_SYSTEM", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"}.items():
        monkeypatch.setenv(k, v)
    assert main(["launch", "--dry-run", "--", *CMD]) == 0  # salloc -N1 -n2
    out, err = capsys.readouterr()
    assert out.startswith("+ srun --mpi=pmi2 -n 2 --ntasks-per-node=2 ")
    assert "srun --mpi=pmi2 (MPICH" in err
    assert main(["launch", "--dry-run", "--srun-mpi", "none", "--", *CMD]) == 0
    assert capsys.readouterr().out.startswith("+ srun --mpi=none -n 2 ")
