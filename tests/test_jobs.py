"""Job scripts and the launch line, without MPI: profiles, checks, rendering, quoting."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import EXIT_USER_ERROR, JobError
from hpctrain.jobs import bind, launch_line
from hpctrain.jobs.job_system import job_system
from hpctrain.jobs.render import render, write_script
from hpctrain.jobs.shell import Var, literal, quote, render_word, resolve_word, word
from hpctrain.jobs.spec import build_spec
from hpctrain.systems.registry import load_system, system_names

REPO = Path(__file__).resolve().parents[1]
# A global batch that splits over every job size below (8 to 1600 ranks): the job
# generator checks the training layout against the job's rank count.
CMD = ["train", "default", "--data.path=datasets/stdlib-char.h5", "--train.batch_size=9600"]
NASTY = ["x'; touch PWNED; '", "$(touch PWNED)", "`touch PWNED`", "a\ntouch PWNED",
         'say "hi" \\ $HOME ${X} * ? ~ # !', "tab\there\rcr", "ünïcødé ∑"]
CLUSTERS = {
    "polaris": dict(nodes=2, walltime="00:30:00", queue="debug", account="P"),
    "aurora": dict(nodes=16, walltime="01:00:00", queue="debug-scaling", account="P"),
    "perlmutter": dict(nodes=2, walltime="00:30:00", queue="debug", account="P"),
    "frontier": dict(nodes=2, walltime="01:00:00", queue="batch", account="P"),
    "pbs": dict(nodes=2, walltime="01:00:00", ranks_per_node=4),
    "slurm": dict(nodes=2, walltime="01:00:00", ranks_per_node=4),
    "local": dict(),
}


def script(system: str, command=CMD, **kw) -> str:
    args = {**CLUSTERS[system], "venv": ".venv", **kw}
    return render(build_spec(system=system, command=list(command), **args))


def directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("#PBS", "#SBATCH"))]


def launch_block(text: str) -> list[str]:
    """The LAUNCH=( ... ) array of a script, as the words bash would build (unexpanded)."""
    lines = text.splitlines()
    start = lines.index("LAUNCH=(")
    end = lines.index(")", start)
    return [w for line in lines[start + 1:end] for w in shlex.split(line)]


def bash_n(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=10)


# ----------------------------------------------------------------------------- quoting

@pytest.mark.parametrize("value", NASTY + ["", "plain", "--train.x=1", "'", '"'])
def test_quote_gives_one_line_word_that_bash_reads_back_verbatim(value, tmp_path):
    q = quote(value)
    assert "\n" not in q
    p = subprocess.run(["bash", "-c", f"printf %s {q}"], capture_output=True, timeout=10,
                       cwd=tmp_path)  # bytes: text mode would turn \r into \n
    assert p.returncode == 0 and p.stdout.decode() == value
    assert not (tmp_path / "PWNED").exists()


def test_words_with_variables_render_and_resolve_the_same():
    w = word("--train.out_dir=", Var("RUN_DIR"), "/x y")
    assert render_word(w) == "--train.out_dir=\"${RUN_DIR}\"'/x y'"
    assert resolve_word(w, {"RUN_DIR": "/r"}) == "--train.out_dir=/r/x y"
    p = subprocess.run(["bash", "-c", f'RUN_DIR="/a b"; printf %s {render_word(w)}'],
                       capture_output=True, text=True, timeout=10)
    assert p.stdout == "--train.out_dir=/a b/x y"


def test_nul_bytes_are_refused():
    with pytest.raises(ValueError):
        quote("a\x00b")
    with pytest.raises(JobError, match="NUL"):
        build_spec(system="local", command=["train", "default", "--data.path=a\x00b"])


# ----------------------------------------------------------------------------- systems

def test_every_builtin_profile_loads_and_renders_a_script_bash_accepts():
    assert set(system_names()) == set(CLUSTERS)
    for name in system_names():
        text = script(name)
        assert text.startswith("#!/bin/bash -l\n")
        assert "set -euo pipefail" in text
        assert bash_n(text).returncode == 0, name
        assert script(name) == text  # deterministic: no timestamps in the text


def test_list_systems_shows_queues_and_limits(capsys):
    assert main(["jobscript", "--list-systems"]) == 0
    out = capsys.readouterr().out
    assert "debug (1-2 nodes, <= 01:00:00)" in out and "prod (10-496 nodes, <= 24:00:00)" in out
    assert "prod (256-10624 nodes, <= 24:00:00)" in out  # Aurora
    for name in CLUSTERS:
        assert re.search(rf"^{name}\s", out, re.M)


def test_custom_profile_from_a_toml_file(tmp_path):
    src = (REPO / "hpctrain/systems/slurm.toml").read_text()
    path = tmp_path / "mycluster.toml"
    path.write_text(src.replace('srun_mpi = "auto"', 'srun_mpi = "pmix"'))
    text = render(build_spec(system=str(path), command=CMD, walltime="01:00:00", venv="none"))
    assert launch_block(text)[:3] == ["srun", "--mpi=pmix", "-n"]
    path.write_text(src.replace("{ranks}", "{rank}"))
    with pytest.raises(JobError, match="unknown placeholder"):
        job_system(str(path))


def launch_words(text: str, cwd: Path, **values: str) -> list[str]:
    """The script's LAUNCH=( ... ) array as bash builds it, with ``values`` as variables."""
    lines = text.splitlines()
    start = lines.index("LAUNCH=(")
    block = "\n".join(lines[start:lines.index(")", start) + 1])
    assign = "".join(f"{k}={quote(v)}\n" for k, v in values.items())
    p = subprocess.run(["bash", "-c", assign + block + '\nprintf "%s\\0" "${LAUNCH[@]}"'],
                       capture_output=True, timeout=10, cwd=cwd)
    assert p.returncode == 0, p.stderr
    return p.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize("system", ["polaris", "local"])
def test_a_spec_s_own_launch_words_are_quoted_through_the_template(system, tmp_path):
    launch = (word(Var("PYTHON")), literal("-m"), literal("hpctrain"), *map(literal, NASTY),
              word(Var("RUN_DIR"), "/x y"))
    text = render(build_spec(system=system, command=CMD, launch=launch,
                             **{**CLUSTERS[system], "venv": "none"}))
    words = launch_words(text, tmp_path, PYTHON="/py", RUN_DIR="/r $(touch PWNED)")
    assert words == ["/py", "-m", "hpctrain", *NASTY, "/r $(touch PWNED)/x y"]
    assert not (tmp_path / "PWNED").exists()
    assert "SRUN_MPI=" not in text and "-m hpctrain.jobs.bind" not in text


# ------------------------------------------------------------------------ per system

def test_polaris_directives_binding_and_environment():
    text = script("polaris")
    assert directives(text) == [
        "#PBS -N hpctrain", "#PBS -A P", "#PBS -q debug", "#PBS -l select=2:system=polaris",
        "#PBS -l place=scatter", "#PBS -l walltime=00:30:00", "#PBS -l filesystems=home:eagle",
        "#PBS -j oe", "#PBS -k doe"]
    words = launch_block(text)
    assert words[:8] == ["mpiexec", "-n", "${NRANKS}", "--ppn", "4", "--depth=8",
                         "--cpu-bind", "depth"]
    # CUDA_VISIBLE_DEVICES = 3 - local_rank % 4, set by the per-rank helper before MPI starts
    assert words[8:18] == ["${PYTHON}", "-m", "hpctrain.jobs.bind", "--device-env",
                           "CUDA_VISIBLE_DEVICES", "--devices", "4", "--order", "reverse", "--"]
    # Resume whatever the run directory holds (a requeue, a resubmission), then the run
    # directory; the walltime reaches the trainer as the job's end ($HPCTRAIN_JOB_END).
    assert words[18:] == ["${PYTHON}", "-m", "hpctrain", *CMD, "--train.resume=auto",
                          "--train.out_dir=${RUN_DIR}"]
    assert "-m hpctrain.jobs.job_end 1800)" in text
    assert "export MPICH_GPU_SUPPORT_ENABLED=1\n" in text
    assert "export OMP_NUM_THREADS=8\n" in text  # = --depth
    assert "module use /soft/modulefiles || die" in text and "module load conda || die" in text
    assert 'cd "$SUBMIT_DIR"' in text and "${PBS_O_WORKDIR:?" in text


def test_pbs_lines_carry_no_comments_and_precede_all_code():
    for name in ("polaris", "aurora", "pbs"):
        lines = script(name).splitlines()
        first_code = next(i for i, line in enumerate(lines[1:], 1)
                          if line and not line.startswith("#"))
        assert all(not line.startswith("#PBS") for line in lines[first_code:])
        for line in directives("\n".join(lines)):
            assert "#" not in line[1:], line


def test_aurora_cpu_list_skips_reserved_cores_and_selects_tiles():
    text = script("aurora")
    assert "#PBS -l select=16" in directives(text) and "#PBS -l filesystems=home:flare" in text
    assert not any("system=" in d for d in directives(text))
    words = launch_block(text)
    assert words[:7] == ["mpiexec", "-n", "${NRANKS}", "--ppn", "12",
                         "--cpu-bind=list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:"
                         "77-84:85-92:93-100", "--pmi=pmix"]
    assert words[7:17] == ["${PYTHON}", "-m", "hpctrain.jobs.bind", "--device-env",
                           "ZE_AFFINITY_MASK", "--devices", "12", "--order", "direct", "--"]
    for line in ("export MPIR_CVAR_ENABLE_GPU=1", "export ZE_FLAT_DEVICE_HIERARCHY=FLAT",
                 "export OMP_NUM_THREADS=8", "module load frameworks || die"):
        assert line in text
    # Fewer ranks per node: still whole sockets, still never cores 0 or 52.
    six = launch_block(script("aurora", ranks_per_node=6))
    assert "--cpu-bind=list:1-17:18-34:35-51:53-69:70-86:87-103" in six
    with pytest.raises(JobError, match="multiple of 2"):
        build_spec(system="aurora", command=CMD, ranks_per_node=5, **CLUSTERS["aurora"])


def test_perlmutter_directives_and_srun_line():
    text = script("perlmutter")
    assert directives(text) == [
        "#SBATCH --job-name=hpctrain", "#SBATCH --account=P", "#SBATCH --qos=debug",
        "#SBATCH --constraint=gpu", "#SBATCH --nodes=2", "#SBATCH --time=00:30:00",
        "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32", "#SBATCH --output=%x-%j.out",
        "#SBATCH --signal=USR1@120"]
    assert launch_block(text)[:7] == ["srun", "-n", "${NRANKS}", "--ntasks-per-node=4",
                                      "--cpus-per-task=32", "--cpu-bind=cores",
                                      "--gpus-per-node=4"]
    assert "export MPICH_GPU_SUPPORT_ENABLED=1" in text and "export OMP_NUM_THREADS=16" in text
    assert "${SLURM_SUBMIT_DIR" in text
    fs = script("perlmutter", filesystems=["scratch", "cfs"])
    assert "#SBATCH --licenses=scratch,cfs" in directives(fs)


def test_frontier_directives_and_srun_line():
    text = script("frontier")
    # Tasks, cores and whole nodes asked for (OLCF Frontier guide: 8 ranks x 7 cores,
    # -S 8 core specialization), so that a shared node cannot break the srun line.
    assert directives(text) == ["#SBATCH -J hpctrain", "#SBATCH -A P", "#SBATCH -p batch",
                                "#SBATCH -N 2", "#SBATCH -t 01:00:00",
                                "#SBATCH --ntasks-per-node=8", "#SBATCH --cpus-per-task=7",
                                "#SBATCH -S 8", "#SBATCH --exclusive",
                                "#SBATCH --output=%x-%j.out", "#SBATCH --signal=USR1@120"]
    assert launch_block(text)[:6] == ["srun", "-N${NNODES}", "-n${NRANKS}", "-c7",
                                      "--gpus-per-task=1", "--gpu-bind=closest"]
    assert "export OMP_NUM_THREADS=7" in text


def test_generic_and_local_profiles():
    pbs = script("pbs", queue="workq", account="acct")
    assert "#PBS -l select=2:mpiprocs=4" in directives(pbs) and "#PBS -q workq" in pbs
    assert launch_block(pbs)[:5] == ["mpiexec", "-n", "${NRANKS}", "-ppn", "4"]
    slurm = script("slurm")
    assert not any("--account" in d or "--partition" in d for d in directives(slurm))
    assert "OMP_NUM_THREADS" not in slurm  # core count unknown: leave it to the user
    local = script("local")
    assert directives(local) == [] and "RANKS_PER_NODE=$(nproc)" in local
    assert launch_block(local)[:3] == ["mpiexec", "-n", "${NRANKS}"]
    with pytest.raises(JobError, match="no batch system; drop --queue"):
        build_spec(system="local", command=CMD, queue="debug")


def test_env_overrides_array_profile_and_setup(tmp_path):
    text = script("polaris", env=["OMP_NUM_THREADS=2", "NCCL_DEBUG=INFO"])
    assert "export OMP_NUM_THREADS=2\n" in text and "export OMP_NUM_THREADS=8" not in text
    assert "export NCCL_DEBUG=INFO" in text
    arr = script("polaris", command=CMD + ["--train.seed={array_index}"], array="0-3%1")
    assert "#PBS -J 0-3%1" in arr and "--train.seed=${ARRAY_INDEX}" in launch_block(arr)
    assert "#PBS -r y" in directives(arr)  # PBS arrays must be rerunnable, in any queue
    sl = script("slurm", command=CMD + ["--train.seed={array_index}"], array="1,3,5%2")
    assert "#SBATCH --array=1,3,5%2" in sl
    nsys = launch_block(script("polaris", profiler="nsys"))
    assert nsys[nsys.index("--nsys-dir") + 1] == "${ATTEMPT_DIR}/nsys"
    setup = tmp_path / "setup.sh"
    setup.write_text("# my modules\nmodule load cray-python\n\nexport FOO=1\n")
    custom = script("polaris", setup_file=str(setup))
    assert "module load cray-python || die" in custom and "export FOO=1 || die" in custom
    assert "module load conda" not in custom
    pre = script("polaris", queue="preemptable", nodes=4, walltime="48:00:00")
    assert "#PBS -r y" in directives(pre)


# ------------------------------------------------------------------------------ checks

@pytest.mark.parametrize("kw, message", [
    (dict(queue="debug", nodes=4), "queue debug on polaris takes at most 2 node(s), you asked "
                                   "for 4: use --nodes 2 or another queue; queues that take 4 "
                                   "node(s) for 00:30:00: debug-scaling, preemptable, capacity"),
    (dict(queue="prod", nodes=4), "takes at least 10 nodes, you asked for 4: use --nodes 10"),
    (dict(queue="debug", walltime="02:00:00"), "allows at most 01:00:00 for 2 node(s), you "
                                               "asked for 02:00:00: use --walltime 01:00:00"),
    (dict(queue="gpu"), "polaris has no queue 'gpu'; use one of: debug (1-2 nodes"),
    (dict(walltime="30:00"), "is not HH:MM:SS"),
    (dict(walltime="00:61:00"), "is not HH:MM:SS"),
    (dict(walltime="00:00:00"), "longer than 00:00:00"),
    (dict(nodes=0), "at least 1 node"),
    (dict(account=None), "polaris needs --account"),
    (dict(queue=None), "polaris needs --queue NAME (one of: debug"),
    (dict(walltime=None), "polaris needs --walltime"),
    (dict(filesystems=["home:grand"]), "no filesystem 'grand'; valid: home, eagle"),
    (dict(queue="prod", nodes=10, array="0-99"), "need a %N throttle with N <= 10"),
    (dict(queue="prod", nodes=10, array="0-99%20"), "need a %N throttle with N <= 10"),
    (dict(array="3-3"), "START < END"),
    (dict(array="1,2,3"), "PBS arrays are START-END"),
    (dict(ranks_per_node=0), "use at least 1"),
    (dict(ranks_per_node=64), "more than the 32 CPUs"),
    (dict(env=["1BAD=x"]), "expected KEY=VALUE"),
    (dict(env=["NOVALUE"]), "expected KEY=VALUE"),
    (dict(command=["prepare", "--corpus", "stdlib"]), "after '--' comes an hpctrain command"),
    (dict(command=[]), "name the command to run after '--'"),
    (dict(command=["train"]), "name a recipe after 'train'"),
    (dict(command=["train", "nosuch"]), "unknown recipe 'nosuch'"),
    (dict(command=CMD + ["--train.max_iter=5"]), "did you mean --train.max_iters?"),
    (dict(command=CMD + ["--train.out_dir=/x"]), "drop --train.out_dir: a job writes into"),
    (dict(profiler="nsys", system="aurora", nodes=2, queue="debug"), "not available on aurora"),
])
def test_bad_requests_fail_with_a_message_that_names_the_fix(kw, message):
    args = {"system": "polaris", **CLUSTERS["polaris"], "command": CMD, **kw}
    with pytest.raises(JobError) as e:
        build_spec(**args)
    assert message in str(e.value)


def test_no_queue_check_lets_a_site_change_its_limits():
    spec = build_spec(system="polaris", command=CMD, check_queue=False,
                      **{**CLUSTERS["polaris"], "nodes": 4, "queue": "newqueue"})
    assert "#PBS -q newqueue" in render(spec) and "--no-queue-check" in spec.argv()


def test_frontier_walltime_depends_on_job_size():
    with pytest.raises(JobError, match="at most 02:00:00 for 2 node"):
        build_spec(system="frontier", command=CMD,
                   **{**CLUSTERS["frontier"], "walltime": "04:00:00"})
    build_spec(system="frontier", command=CMD, **{**CLUSTERS["frontier"], "nodes": 200,
                                                  "walltime": "12:00:00"})


# ------------------------------------------------------------------------- injection

@pytest.mark.parametrize("field", ["job_name", "account", "queue"])
@pytest.mark.parametrize("value", NASTY[:4] + ["a b", "a#b", "-x"])
def test_directive_values_outside_a_safe_set_are_refused(field, value):
    with pytest.raises(JobError, match="cannot carry safely"):
        build_spec(system="pbs", command=CMD, walltime="01:00:00", **{field: value})


def test_user_values_are_quoted_into_single_words_and_never_break_lines():
    overrides = [f"--train.sample_prompt={v}" for v in NASTY] + [f"--data.path={NASTY[1]}"]
    env = [f"V{i}={v}" for i, v in enumerate(NASTY)]
    text = render(build_spec(system="pbs", command=CMD + overrides, walltime="01:00:00",
                             env=env, run_root=NASTY[3], venv=NASTY[0]))
    assert bash_n(text).returncode == 0
    lines = text.splitlines()
    assert not any(line.lstrip().startswith(("touch", "`touch", "$(touch")) for line in lines)
    for o in overrides:  # each override is exactly one element of the launch array
        assert quote(o) in text
    for i, v in enumerate(NASTY):
        assert f"export V{i}={quote(v)}\n" in text
    assert f"RUN_ROOT={quote(NASTY[3])}\n" in text
    # The header comment spells the command on comment lines only.
    header = lines[lines.index("set -euo pipefail") + 1:lines.index("die() { echo \"hpctrain "
                                                                     "job: error: $*\" >&2; "
                                                                     "exit 1; }")]
    assert all(line.startswith("#") or line == "" for line in header)


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


# --------------------------------------------------------------------------- the CLI

def test_cli_prints_or_writes_atomically_and_writes_nothing_on_bad_input(tmp_path, capsys):
    base = ["jobscript", "--system", "polaris", "--nodes", "2", "--walltime", "00:30:00",
            "--queue", "debug", "--account", "P", "--venv", "none"]
    assert main(base + ["--", *CMD]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash -l\n#PBS -N hpctrain\n")
    out = tmp_path / "job.sh"
    assert main(base + ["--output", str(out), "--", *CMD]) == 0
    msg = capsys.readouterr().out
    assert f"qsub {out}" in msg and "runs/hpctrain/metrics.jsonl" in msg
    assert out.read_text() == printed and out.stat().st_mode & 0o777 == 0o755
    bad = tmp_path / "bad.sh"
    assert main([*base[:4], "4", *base[5:], "--output", str(bad), "--", *CMD]) == \
        EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: queue debug on polaris takes at most 2 node(s)")
    assert not bad.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["job.sh"]
    assert main(base + ["--output", str(tmp_path / "no/dir/x.sh"), "--", *CMD]) == \
        EXIT_USER_ERROR


def test_write_script_replaces_in_one_step(tmp_path):
    path = tmp_path / "s.sh"
    path.write_text("old")
    write_script(path, "#!/bin/bash\n")
    assert path.read_text() == "#!/bin/bash\n" and list(tmp_path.iterdir()) == [path]


# ------------------------------------------------------------------ jobscripts/ in sync

def _recorded_commands() -> list[list[str]]:
    text = (REPO / "jobscripts" / "generate.sh").read_text().replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in text.splitlines()
            if line.startswith("hpctrain jobscript ")]


def test_the_profiler_option_and_its_old_name(capsys):
    base = ["jobscript", "--system", "polaris", "--nodes", "1", "--walltime", "00:30:00",
            "--queue", "debug", "--account", "P", "--venv", "none"]
    assert main(base + ["--profiler", "nsys", "--", *CMD]) == 0
    new = capsys.readouterr()
    assert "--nsys-dir" in new.out and "--profiler nsys" in new.out and not new.err
    assert main(base + ["--profile", "nsys", "--", *CMD]) == 0
    old = capsys.readouterr()
    assert old.out == new.out
    assert old.err == "--profile -> --profiler (deprecated: the old name goes in the next release)\n"


def test_jobscripts_examples_are_what_the_generator_makes(tmp_path, capsys, monkeypatch):
    commands = _recorded_commands()
    names = {Path(c[c.index("--output") + 1]).name for c in commands}
    assert names == {p.name for p in (REPO / "jobscripts").glob("*.sh")} - {"generate.sh"}
    assert len(names) == 5
    monkeypatch.chdir(REPO)
    for argv in commands:
        target = REPO / argv[argv.index("--output") + 1]
        fresh = tmp_path / target.name
        argv[argv.index("--output") + 1] = str(fresh)
        assert main(argv) == 0, capsys.readouterr().err
        assert fresh.read_bytes() == target.read_bytes(), (
            f"jobscripts/{target.name} is out of date with the generator; regenerate the "
            "examples with `bash jobscripts/generate.sh` and review the diff")
        assert bash_n(target.read_text()).returncode == 0


def test_job_commands_import_neither_torch_nor_mpi4py():
    """They run on login nodes, where importing torch is slow and MPI must not start."""
    code = ("import sys, io, contextlib\n"
            "from hpctrain.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['jobscript', '--system', 'polaris', '--nodes', '2', '--walltime',\n"
            "                 '00:30:00', '--queue', 'debug', '--account', 'P', '--', 'train',\n"
            "                 'default']) == 0\n"
            "    assert main(['launch', '--dry-run', '--ranks', '2', '--', 'train',\n"
            "                 'default']) == 0\n"
            "print(sorted(m for m in ('torch', 'mpi4py', 'numpy', 'h5py') if m in sys.modules))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


def test_a_command_without_the_separator_is_explained(capsys):
    assert main(["launch", "--dry-run", "train", "default"]) == EXIT_USER_ERROR
    assert "the command to run goes after '--'" in capsys.readouterr().err


def test_the_training_layout_is_checked_against_the_jobs_ranks():
    # Polaris: 4 ranks per node. 2 nodes = 8 ranks: pp=4 fits, pp=3 does not.
    polaris = {**CLUSTERS["polaris"], "nodes": 2}
    build_spec(system="polaris", command=[*CMD, "--parallel.pp=4", "--train.batch_size=12"],
               **polaris)
    with pytest.raises(JobError, match=r"8 rank\(s\) cannot form pipelines of --parallel.pp=3"):
        build_spec(system="polaris", command=[*CMD, "--parallel.pp=3"], **polaris)
    with pytest.raises(JobError, match="cannot be split evenly over 8"):
        build_spec(system="polaris", command=[*CMD, "--train.batch_size=12"], **polaris)
    # --ranks-per-node changes the count: 2 nodes x 3 ranks take pp=3.
    build_spec(system="polaris", command=[*CMD, "--parallel.pp=3", "--train.batch_size=12"],
               **{**polaris, "ranks_per_node": 3})


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
    nodefile.write_text("h1\nh2\n")  # one line per host: the profile decides
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


# ------------------------------------------------------------ queue rules (issue C)

def _spec(system, **kw):
    """A request whose global batch splits over its ranks, however many."""
    per_node = kw.get("ranks_per_node") or load_system(system).launch.ranks_per_node
    ranks = kw.get("nodes", 1) * per_node
    return build_spec(system=system, command=[*CMD[:3], f"--train.batch_size={ranks}"],
                      account="P", **kw)


@pytest.mark.parametrize("nodes, edge", [(10, "03:00:00"), (24, "03:00:00"), (25, "06:00:00"),
                                         (99, "06:00:00"), (100, "24:00:00"),
                                         (496, "24:00:00")])
def test_polaris_prod_walltime_by_routed_queue(nodes, edge):
    # ALCF user guide, Polaris "Running Jobs": prod routes to small (10-24 nodes, 3 h),
    # medium (25-99, 6 h), large (100-496, 24 h).
    _spec("polaris", queue="prod", nodes=nodes, walltime=edge)
    h, m, s = edge.split(":")
    with pytest.raises(JobError, match=rf"prod on polaris allows at most {edge} for {nodes} "):
        _spec("polaris", queue="prod", nodes=nodes, walltime=f"{h}:{m}:01")


@pytest.mark.parametrize("nodes, edge", [(256, "12:00:00"), (1024, "12:00:00"),
                                         (1025, "18:00:00"), (1999, "18:00:00"),
                                         (2000, "24:00:00")])
def test_aurora_prod_walltime_by_size(nodes, edge):
    _spec("aurora", queue="prod", nodes=nodes, walltime=edge)
    with pytest.raises(JobError, match=rf"prod on aurora allows at most {edge} for {nodes} "):
        _spec("aurora", queue="prod", nodes=nodes, walltime=edge[:-2] + "01")


@pytest.mark.parametrize("system, queue", [
    (s, q) for s in ("polaris", "aurora") for q in load_system(s).batch.queues])
def test_every_alcf_queue_has_a_five_minute_minimum(system, queue):
    nodes = max(load_system(system).batch.queues[queue].min_nodes, 1)
    _spec(system, queue=queue, nodes=nodes, walltime="00:05:00")
    with pytest.raises(JobError, match=rf"queue {queue} on {system} takes jobs of at least "
                                       r"00:05:00, you asked for 00:04:59"):
        _spec(system, queue=queue, nodes=nodes, walltime="00:04:59")


@pytest.mark.parametrize("system, queue, limit", [
    ("polaris", "debug", 1), ("polaris", "debug-scaling", 1), ("polaris", "preemptable", 20),
    ("polaris", "prod", 10), ("aurora", "debug", 1), ("aurora", "debug-scaling", 1),
    ("aurora", "prod", 10)])
def test_alcf_array_throttle_per_queue_and_rerunnable_arrays(system, queue, limit):
    # ALCF user guide, "Example Job Scripts" > "Limits on job arrays" and each system's
    # "Running Jobs" queue table: sub-jobs count against the queue's concurrent-job limit.
    q = load_system(system).batch.queues[queue]
    kw = dict(queue=queue, nodes=q.min_nodes, walltime="00:30:00")
    text = render(_spec(system, array=f"0-31%{limit}", **kw))
    assert f"#PBS -J 0-31%{limit}" in directives(text)
    assert directives(text).count("#PBS -r y") == 1  # PBS reruns array sub-jobs
    with pytest.raises(JobError, match=rf"queue {queue} need a %N throttle with N <= {limit}"):
        _spec(system, array=f"0-31%{limit + 1}", **kw)
    with pytest.raises(JobError, match=rf"queue {queue} need a %N throttle with N <= {limit}"):
        _spec(system, array="0-31", **kw)


def test_every_pbs_array_is_rerunnable():
    for system, kw in (("pbs", dict(walltime="01:00:00")),
                       ("polaris", dict(queue="capacity", nodes=1, walltime="01:00:00")),
                       ("aurora", dict(queue="capacity", nodes=1, walltime="00:30:00"))):
        text = render(_spec(system, array="0-3", **kw))
        assert "#PBS -J 0-3" in directives(text) and "#PBS -r y" in directives(text), system
    assert "#PBS -r y" not in script("pbs")  # not without an array


# Every queue limit of the site profiles, as the sites' guides state it; the profile
# comments cite the guide, section and the commit of the copy read. A row: system, queue,
# [min, max] nodes, max walltime at the largest job, the smaller jobs' tighter limits,
# min walltime, array throttle.
SOURCED_QUEUES = [
    # ALCF user guide, Polaris "Running Jobs" > "Queues" (queue and prod routing tables);
    # "Example Job Scripts" > "Limits on job arrays".
    ("polaris", "debug", [1, 2], "01:00:00", (), "00:05:00", 1),
    ("polaris", "debug-scaling", [1, 10], "01:00:00", (), "00:05:00", 1),
    ("polaris", "prod", [10, 496], "24:00:00",
     ((24, "03:00:00"), (99, "06:00:00"), (496, "24:00:00")), "00:05:00", 10),
    ("polaris", "preemptable", [1, 10], "72:00:00", (), "00:05:00", 20),
    ("polaris", "capacity", [1, 4], "168:00:00", (), "00:05:00", None),
    # ALCF user guide, Aurora "Running Jobs on Aurora" > "Queues"; "Known Issues" > "Job
    # Array Submitted to prod Never Runs".
    ("aurora", "debug", [1, 2], "01:00:00", (), "00:05:00", 1),
    ("aurora", "debug-scaling", [2, 256], "01:00:00", (), "00:05:00", 1),
    ("aurora", "prod", [256, 10624], "24:00:00",
     ((1024, "12:00:00"), (1999, "18:00:00"), (10624, "24:00:00")), "00:05:00", 10),
    ("aurora", "capacity", [1, 16], "168:00:00", (), "00:05:00", None),
    # OLCF Frontier user guide, "Scheduling Policy": "Job Priority by Node Count",
    # "extended Partition (queue) Policy", "debug Quality of Service Class".
    ("frontier", "batch", [1, 9472], "12:00:00",
     ((91, "02:00:00"), (183, "06:00:00"), (9472, "12:00:00")), None, None),
    ("frontier", "debug", [1, 9472], "02:00:00", (), None, None),
    ("frontier", "extended", [1, 64], "24:00:00", (), None, None),
    # NERSC "QOSes and Charges" (docs.nersc.gov/jobs/policy/): unverified, see
    # perlmutter.toml; the walltimes agree with sacctmgr output quoted elsewhere.
    ("perlmutter", "debug", [1, 8], "00:30:00", (), None, None),
    ("perlmutter", "regular", [1, 1536], "48:00:00", (), None, None),
]


def _seconds(hms):
    h, m, s = (int(x) for x in hms.split(":"))
    return h * 3600 + m * 60 + s


def _plus_one_second(hms):
    s = _seconds(hms) + 1
    return f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def test_the_profiles_hold_exactly_the_sourced_queues():
    rows = {(s, q): row for s, q, *row in SOURCED_QUEUES}
    for system in ("polaris", "aurora", "frontier", "perlmutter"):
        for name, q in load_system(system).batch.queues.items():
            assert (system, name) in rows, f"{system} {name}: add its source to SOURCED_QUEUES"
            nodes, wall, by_nodes, min_wall, throttle = rows[system, name]
            assert [q.min_nodes, q.max_nodes] == nodes, (system, name)
            assert q.max_walltime == _seconds(wall), (system, name)
            assert q.walltime_by_nodes == tuple((n, _seconds(w)) for n, w in by_nodes)
            assert q.min_walltime == (_seconds(min_wall) if min_wall else 0), (system, name)
            assert q.array_throttle == throttle, (system, name)
    assert len(rows) == sum(len(load_system(s).batch.queues)
                            for s in ("polaris", "aurora", "frontier", "perlmutter"))


@pytest.mark.parametrize("system, queue, nodes, wall", [
    (s, q, n, w) for s, q, n, w, *_ in SOURCED_QUEUES])
def test_each_queue_takes_its_largest_job_and_refuses_one_node_more(system, queue, nodes,
                                                                     wall):
    _spec(system, queue=queue, nodes=nodes[1], walltime=wall)
    with pytest.raises(JobError, match=rf"queue {queue} on {system} takes at most "
                                       rf"{nodes[1]} node\(s\), you asked for {nodes[1] + 1}"):
        _spec(system, queue=queue, nodes=nodes[1] + 1, walltime="00:30:00")
    if nodes[0] > 1:
        _spec(system, queue=queue, nodes=nodes[0], walltime="00:30:00")
        with pytest.raises(JobError, match=rf"queue {queue} on {system} takes at least "
                                           rf"{nodes[0]} nodes, you asked for {nodes[0] - 1}"):
            _spec(system, queue=queue, nodes=nodes[0] - 1, walltime="00:30:00")


@pytest.mark.parametrize("system, queue, nodes, wall", [
    (s, q, n, w) for s, q, n, w, *_ in SOURCED_QUEUES])
def test_each_queue_takes_its_walltime_limit_and_refuses_a_second_more(system, queue, nodes,
                                                                       wall):
    _spec(system, queue=queue, nodes=nodes[0], walltime=_limit_for(system, queue, nodes[0]))
    _spec(system, queue=queue, nodes=nodes[1], walltime=wall)
    with pytest.raises(JobError, match=rf"queue {queue} on {system} allows at most {wall} "
                                       rf"for {nodes[1]} node\(s\), you asked for "
                                       rf"{_plus_one_second(wall)}"):
        _spec(system, queue=queue, nodes=nodes[1], walltime=_plus_one_second(wall))


def _limit_for(system, queue, n):
    row = next(r for r in SOURCED_QUEUES if r[:2] == (system, queue))
    return next((w for most, w in row[4] if n <= most), row[3])


def test_perlmutter_qos_it_does_not_model_need_no_queue_check():
    with pytest.raises(JobError, match=r"perlmutter has no queue 'premium'; use one of: "
                                       r"debug \(1-8 nodes, <= 00:30:00\); regular "
                                       r"\(1-1536 nodes, <= 48:00:00\) \(or --no-queue-check"):
        _spec("perlmutter", queue="premium", nodes=2, walltime="01:00:00")
    text = render(_spec("perlmutter", queue="premium", nodes=2, walltime="01:00:00",
                        check_queue=False))
    assert "#SBATCH --qos=premium" in directives(text)


def test_frontier_largest_job_debug_qos_and_ranks_per_node():
    kw = dict(walltime="12:00:00", queue="batch")
    _spec("frontier", nodes=9472, **kw)
    with pytest.raises(JobError, match="takes at most 9472 node"):
        _spec("frontier", nodes=9473, **kw)
    text = render(_spec("frontier", nodes=4, queue="debug", walltime="02:00:00"))
    assert "#SBATCH -p batch" in directives(text) and "#SBATCH -q debug" in directives(text)
    assert "#SBATCH -p debug" not in text  # debug is a QOS, not a partition
    with pytest.raises(JobError, match="queue debug on frontier allows at most 02:00:00"):
        _spec("frontier", nodes=4, queue="debug", walltime="02:00:01")
    _spec("frontier", nodes=2, queue="batch", walltime="01:00:00", ranks_per_node=8)
    with pytest.raises(JobError, match="a frontier node takes at most 8 ranks"):
        _spec("frontier", nodes=2, queue="batch", walltime="01:00:00", ranks_per_node=9)


def _before_launch(text: str, line: str) -> bool:
    """``line`` is in the script and runs before the launcher does."""
    return line in text and text.index(line) < text.index(launch_block(text)[0] + " ")


def test_polaris_links_the_gpu_transfer_library_for_gpu_aware_mpi():
    # ALCF Polaris guide: GPU-aware Cray MPICH needs the GTL library at run time.
    text = script("polaris")
    assert "export MPICH_GPU_SUPPORT_ENABLED=1" in text
    assert _before_launch(text, "module load craype-accel-nvidia80 ||")


def test_frontier_puts_cray_libraries_first_and_miopen_cache_on_local_disk():
    text = script("frontier")
    assert _before_launch(text, "module load craype-accel-amd-gfx90a ||")
    assert _before_launch(text, 'export LD_LIBRARY_PATH="${CRAY_LD_LIBRARY_PATH}:${LD_LIBRARY_PATH}"')
    assert _before_launch(text, 'export MIOPEN_USER_DB_PATH="/tmp/')
    assert 'export MIOPEN_CUSTOM_CACHE_DIR="${MIOPEN_USER_DB_PATH}"' in text


@pytest.mark.parametrize("name", ["daos_user", "daos_user_fs", "daos_perf", "daos_perf_fs"])
def test_aurora_accepts_every_name_the_guides_give_daos(name):
    text = script("aurora", filesystems=["flare", name])
    assert f"#PBS -l filesystems=flare:{name}" in directives(text)


def test_aurora_refuses_a_filesystem_it_does_not_list():
    with pytest.raises(JobError, match="no filesystem 'daos'; valid: home, flare, daos_user, "
                                       "daos_user_fs, daos_perf, daos_perf_fs"):
        script("aurora", filesystems=["daos"])
