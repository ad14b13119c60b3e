"""Job scripts rendered for every system, without MPI: quoting, per-system directives and
launch lines, hostile values, the environment set before the launcher."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.errors import JobError
from hpctrain.jobs.job_system import job_system
from hpctrain.jobs.render import render
from hpctrain.jobs.shell import Var, literal, quote, render_word, resolve_word, word
from hpctrain.jobs.spec import build_spec
from hpctrain.systems.registry import system_names
from tests.jobs_common import CLUSTERS, CMD, NASTY, REPO, bash_n, directives, launch_block, script


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

def test_every_builtin_system_loads_and_renders_a_script_bash_accepts():
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


def test_custom_system_from_a_toml_file(tmp_path):
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
        "#SBATCH --open-mode=append",
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
                                "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append",
                                "#SBATCH --signal=USR1@120"]
    assert launch_block(text)[:6] == ["srun", "-N${NNODES}", "-n${NRANKS}", "-c7",
                                      "--gpus-per-task=1", "--gpu-bind=closest"]
    assert "export OMP_NUM_THREADS=7" in text


def test_generic_and_local_systems():
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


def test_env_overrides_array_profiler_and_setup(tmp_path):
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


@pytest.mark.parametrize("system", ["polaris", "aurora", "perlmutter", "frontier", "slurm",
                                    "pbs", "local"])
def test_every_script_reads_tokenizers_from_shared_caches_and_keeps_compiled_kernels(system):
    """Compute nodes have no internet and lose /tmp after the job: GPT-2's BPE file comes
    from a shared cache (tiktoken's default is /tmp), the hub is not asked, and
    torch.compile's kernels stay in the run directory across requeues; a value the user
    exported wins."""
    text = script(system)
    for line in ('export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-$HOME/.cache/tiktoken}',
                 'export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}',
                 'export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$RUN_DIR/cache/'
                 'torchinductor}'):
        assert line in text and text.index(line) < text.index("\nLAUNCH=("), line
