"""Render a ``JobSpec`` into a batch script (Jinja2 templates in ``templates/``).

Safety: the environment prints only ``Shell`` text (``finalize`` rejects a plain ``str``),
so every user value must pass the ``q`` filter (``shell.quote``) or directive validation
on its way into the script. After rendering, every ``#PBS``/``#SBATCH`` line is checked
once more and the whole script goes through ``bash -n``. Nothing is written to disk
until all of that has passed; then ``write_script`` replaces the file atomically.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import jinja2

from hpctrain.errors import JobError
from hpctrain.file_modes import umask
from hpctrain.jobs import validate
from hpctrain.jobs.command import ARRAY_INDEX
from hpctrain.jobs.launch_line import OMPI_SIGKILL_ENV, OMPI_SIGKILL_S, launch_line, placement
from hpctrain.jobs.shell import (Shell, Var, expand, literal, quote, render_word, render_words,
                                 resolve_word, with_home, word)
from hpctrain.jobs.spec import JobSpec

# PBS reruns the sub-jobs of an array, so it needs them rerunnable: -r y with every -J
# (ALCF user guide, Polaris "Running Jobs", job arrays).
ARRAY_DIRECTIVES = {"pbs": ("-J {array}", "-r y"), "slurm": ("--array={array}",)}
SUBMIT = {"pbs": "qsub", "slurm": "sbatch", "none": "bash"}
TEMPLATES = {"pbs": "pbs.sh.j2", "slurm": "slurm.sh.j2", "none": "local.sh.j2"}
RECORDS = "jobscript.sh, launch.txt, env.txt, modules.txt, git.txt, job.txt, exit_code"
"""What each attempt of a job writes into ``<run dir>/jobs/<job id>/``."""
RUN_STATUS_MODULE = "hpctrain.train.run_status"
"""Read by the script after training: finished, or stopped early (``status.json``)."""
JOB_END_MODULE = "hpctrain.jobs.job_end"
ENV_RECORD_MODULE = "hpctrain.jobs.env_record"
"""Writes the attempt's ``env.txt`` (owner-only, secrets hidden)."""
"""Asked by the script for the job's end (squeue, qstat), which the trainer stops before."""
_WIDTH = 88


def _only_shell(value):
    if isinstance(value, (Shell, int)) and not isinstance(value, bool):
        return value
    raise TypeError(f"template printed {value!r} without quoting it; use the q filter")


def _comment(text) -> Shell:
    """Text for a ``#`` comment: control characters become spaces (one line)."""
    return Shell(re.sub(r"[\x00-\x1f\x7f]", " ", str(text)))


_ENV = jinja2.Environment(loader=jinja2.PackageLoader("hpctrain.jobs", "templates"),
                          autoescape=False, undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                          finalize=_only_shell)
_ENV.filters["q"] = quote
_ENV.filters["comment"] = _comment


def _wrap(words: list[str], first: str, rest: str) -> list[str]:
    """Greedy line wrapping of (already quoted) words for the header comment."""
    lines, current, indent = [], [], first
    for w in words:
        if current and len(indent) + len(" ".join(current + [w])) > _WIDTH:
            lines.append(indent + " ".join(current))
            current, indent = [], rest
        current.append(w)
    lines.append(indent + " ".join(current))
    return lines


def _units(argv: list[str]) -> list[str]:
    """Quoted words, with each ``--flag value`` pair kept together for wrapping."""
    units, i = [], 0
    while i < len(argv):
        if (argv[i].startswith("--") and argv[i] != "--" and "=" not in argv[i]
                and i + 1 < len(argv) and not argv[i + 1].startswith("-")):
            units.append(f"{quote(argv[i])} {quote(argv[i + 1])}")
            i += 2
        else:
            units.append(quote(argv[i]))
            i += 1
    return units


def _command_words(spec: JobSpec) -> list:
    """The hpctrain arguments as words; ``{array_index}`` becomes the sub-job's index."""
    words = []
    for arg in spec.command:
        if spec.array and ARRAY_INDEX in arg:
            pieces = arg.split(ARRAY_INDEX)
            parts = [pieces[0]]
            for piece in pieces[1:]:
                parts += [Var("ARRAY_INDEX"), piece]
            words.append(word(*parts))
        else:
            words.append(literal(arg))
    if spec.command[0] == "doctor":
        words.append(word("--json=", Var("ATTEMPT_DIR"), "/doctor.json"))
        return words
    if not any(arg.startswith("--train.resume") for arg in spec.command):
        words.append(literal("--train.resume=auto"))  # requeued or resubmitted: go on
    words.append(word("--train.out_dir=", Var("RUN_DIR")))
    return words


def _run_dir(spec: JobSpec) -> Shell:
    """The run directory as a shell word: ``--run-dir`` (``{array_index}`` becomes the
    sub-job's index), else ``$RUN_ROOT/<job name>`` (``-<index>`` for an array)."""
    if spec.run_dir:
        pieces = spec.run_dir.split(ARRAY_INDEX)
        parts = [pieces[0]]
        for piece in pieces[1:]:
            parts += [Var("ARRAY_INDEX"), piece]
        return render_word(word(*with_home(parts[0]), *parts[1:]))
    if spec.array:
        return render_word(word(Var("RUN_ROOT"), f"/{spec.job_name}-", Var("ARRAY_INDEX")))
    return render_word(word(Var("RUN_ROOT"), f"/{spec.job_name}"))


def _directives(spec: JobSpec, place) -> list[Shell]:
    b = spec.system.batch
    sep = ":" if b.scheduler == "pbs" else ","
    queue = b.queues.get(spec.queue) if spec.queue else None
    values = {"job_name": spec.job_name, "account": spec.account,
              "queue": queue.partition or spec.queue if queue else spec.queue,
              "nodes": str(spec.nodes), "walltime": spec.walltime,
              "filesystems": sep.join(spec.filesystems) or None,
              "ranks_per_node": str(place.ranks_per_node) if place.ranks_per_node else None,
              "gpus_per_node": str(spec.system.launch.gpus_per_node),
              "cpus_per_rank": str(place.cpus_per_rank) if place.cpus_per_rank else None,
              "array": spec.array}
    templates = list(b.directives)
    if queue:
        templates += queue.directives
    if spec.array:
        templates += [t for t in ARRAY_DIRECTIVES[b.scheduler] if t not in templates]
    out = []
    for t in templates:
        needed = re.findall(r"\{([a-z_]+)\}", t)
        if any(not values.get(k) for k in needed):
            continue  # e.g. no --account on a generic cluster: no -A line
        text = resolve_word(expand(t, {k: literal(values[k]) for k in needed}))
        out.append(Shell(validate.directive_line(f"{b.directive_prefix} {text}")))
    return out


def _launch_lines(spec: JobSpec, place, plugin: str | None) -> list[Shell]:
    """The lines of the script's ``LAUNCH=( ... )`` array: the system's launcher, the
    per-rank wrapper, then the program with one argument per line; or the spec's own
    ``launch`` words on one line."""
    if spec.launch is not None:
        return [render_words(spec.launch)]
    p = spec.system
    rpn_word = None if place.ranks_per_node else (Var("RANKS_PER_NODE"),)
    srun_mpi = (Var("SRUN_MPI"),) if plugin == "auto" else literal(plugin) if plugin else None
    line = launch_line(p, place, nodes=(Var("NNODES"),), ranks=(Var("NRANKS"),),
                       python=(Var("PYTHON"),), command=_command_words(spec),
                       nodefile=(Var("PBS_NODEFILE"),) if p.batch.scheduler == "pbs" else None,
                       ranks_per_node=rpn_word, profiler=spec.profiler,
                       profile_dir=word(Var("ATTEMPT_DIR"), f"/{spec.profiler}"),
                       srun_mpi=srun_mpi)
    n_head = 4 + (spec.command[0] == "train")  # python -m hpctrain train RECIPE
    program = [render_words(line.program[:n_head])] + \
        [render_word(w) for w in line.program[n_head:]]
    groups = [render_words(line.launcher)]
    if line.wrapper:
        groups.append(render_words(line.wrapper))
    return groups + program


def context(spec: JobSpec) -> dict:
    p = spec.system
    b, la = p.batch, p.launch
    place = placement(p, spec.ranks_per_node)
    # A spec's own launch words start no ranks: no srun plugin to choose in the job.
    plugin = spec.mpi_plugin if la.uses_srun_mpi and spec.launch is None else None
    env = {k: v for k, v in la.env}
    if place.threads_per_rank:
        env["OMP_NUM_THREADS"] = str(place.threads_per_rank)
    env.update(dict(spec.env))
    setup = la.setup if spec.setup is None else spec.setup
    submit = SUBMIT[b.scheduler]
    header = [_comment(f"hpctrain job script for {p.name}"), _comment(p.description),
              Shell(""),
              Shell("Made by this command (edit the script freely, or change the command and "
                    "run it again):")]
    header += _wrap(_units(spec.argv()), "  ", "    ")
    header += [
        Shell("Submit it from the directory that relative paths (data, --venv, --run-root) "
              "refer to:"),
        Shell(f"  {submit} SCRIPT"),
        _comment(f"Results go to {run_dir_text(spec)}/ (metrics.jsonl, checkpoints/, "
                 "summary.json, status.json),"),
        Shell(f"and each attempt's records to jobs/<job id>/ there: {RECORDS}."),
        Shell("Submitted again, or requeued, the job continues from the last checkpoint there."),
    ]
    return {
        "directives": _directives(spec, place),
        "header": [Shell(f"# {h}" if h else "#") for h in header],
        "system": quote(p.name),
        "setup": [(Shell(cmd), quote(f"setup step failed: {cmd}")) for cmd in setup],
        "needs_module": any(cmd.split()[:1] == ["module"] for cmd in setup),
        "activate": render_word(with_home(spec.venv) + ("/bin/activate",)) if spec.venv else None,
        "env": [(Shell(k), quote(v)) for k, v in env.items()],
        "run_root": None if spec.run_dir else render_word(with_home(spec.run_root)),
        "run_dir": _run_dir(spec),
        "ranks_per_node": place.ranks_per_node,
        "launcher_program": quote(la.launcher[0]),
        "check_venv_mpiexec": b.scheduler != "none" and la.launcher[0] == "mpiexec",
        "launch_groups": _launch_lines(spec, place, plugin),
        "detect_srun_mpi": plugin == "auto",
        "submit": Shell(submit),
        "results": Shell("doctor.json in jobs/<job id>/" if spec.command[0] == "doctor"
                         else "metrics.jsonl, summary.json"),
        "run_status": Shell(RUN_STATUS_MODULE) if _trains(spec) else None,
        "stop_exit_code": spec.stop_exit_code,
        "job_end": _job_end(spec),
        "env_record": Shell(ENV_RECORD_MODULE),
        "ompi_sigkill": None if la.launcher[0] == "srun" else
        Shell(f"export {OMPI_SIGKILL_ENV}=${{{OMPI_SIGKILL_ENV}:-{OMPI_SIGKILL_S}}}"),
    }


def _trains(spec: JobSpec) -> bool:
    """The job runs ``hpctrain train`` itself (not doctor, not a study runner)."""
    return spec.launch is None and spec.command[0] == "train"


def _job_end(spec: JobSpec) -> Shell | None:
    """``hpctrain.jobs.job_end [walltime seconds]``: under a batch system, the job's end."""
    if spec.system.batch.scheduler == "none":
        return None
    seconds = validate.parse_walltime(spec.walltime) if spec.walltime else None
    return Shell(JOB_END_MODULE + (f" {seconds}" if seconds else ""))


def run_dir_text(spec: JobSpec) -> str:
    """The run directory as a user reads it (``<index>`` for an array's)."""
    if spec.run_dir:
        return spec.run_dir.replace(ARRAY_INDEX, "<index>")
    return f"{spec.run_root}/{spec.job_name}" + ("-<index>" if spec.array else "")


def render(spec: JobSpec) -> str:
    """The job script's text. Deterministic: the same spec gives the same bytes."""
    template = _ENV.get_template(TEMPLATES[spec.system.batch.scheduler])
    text = template.render(**context(spec))
    _check_directives(text, spec)
    check_syntax(text)
    return text


def _check_directives(text: str, spec: JobSpec) -> None:
    prefix = spec.system.batch.directive_prefix
    if not prefix:
        return
    for line in text.splitlines():
        if line.lstrip().startswith(prefix):
            validate.directive_line(line)


def check_syntax(text: str) -> None:
    """``bash -n`` on the script, when bash is available (it is on every login node)."""
    bash = shutil.which("bash")
    if bash is None:  # pragma: no cover - no bash on this machine
        return
    p = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise JobError("the rendered script does not parse (bash -n): "
                       f"{p.stderr.strip()}; check the lines of --setup or the system file")


def write_script(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (a reader never sees half a script), executable
    and readable as the umask allows (0755 under umask 022, 0750 under 027): the temporary
    file is created 0600 and a fixed 0755 would ignore a project's umask."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise JobError(f"--output {path} is a directory; name the script file, e.g. {path}/job.sh")
    if not folder.is_dir():
        raise JobError(f"--output {path}: directory {folder} does not exist; create it first")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o777 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
