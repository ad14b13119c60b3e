"""A job request, validated in full before anything is rendered or written.

``build_spec(...)`` takes what ``hpctrain jobscript`` was given and returns a ``JobSpec``
or raises one ``JobError`` naming the fix. ``JobSpec.argv()`` spells the request as a
canonical command line, recorded in the script so it can be regenerated.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import JobError
from hpctrain.jobs import validate
from hpctrain.jobs.command import check_command, data_warnings
from hpctrain.jobs.launch_line import placement
from hpctrain.jobs.job_system import job_system, srun_mpi as check_srun_mpi
from hpctrain.systems.registry import System

DEFAULT_JOB_NAME = "hpctrain"
DEFAULT_RUN_ROOT = "runs"
STOP_EXIT_CODE = 75
"""A job whose training stopped early (signal, time limit) and saved a checkpoint exits
with this: EX_TEMPFAIL of sysexits.h, "a temporary failure: try again". Slurm sites can
requeue on it (``RequeueExit=75``); ``--stop-exit-code 0`` for ``afterok`` chains."""
OUT_DIR_REASON = ("a job writes into its run directory, <run root>/<job name>/, the same for "
                  "every requeue and resubmission so that the run continues there; use "
                  "--run-dir DIR to name another")


@dataclass(frozen=True)
class JobSpec:
    system: System
    nodes: int
    walltime: str | None
    queue: str | None
    account: str | None
    job_name: str
    filesystems: tuple
    env: tuple
    """User ``(KEY, VALUE)`` pairs; they override the system's ``[launch.env]``."""
    array: str | None
    profiler: str | None
    ranks_per_node: int | None
    venv: str | None
    setup_file: str | None
    setup: tuple | None
    """Shell commands replacing the system's setup (from ``setup_file``), or None."""
    run_root: str
    command: tuple
    check_queue: bool = True
    srun_mpi: str | None = None
    """``--srun-mpi``: replaces the system's ``srun_mpi``."""
    run_dir: str | None = None
    """``--run-dir``: the run directory itself (``{array_index}`` allowed), instead of
    ``<run_root>/<job_name>``."""
    stop_exit_code: int = STOP_EXIT_CODE
    """The script's exit status when training stopped early with a checkpoint."""
    warnings: tuple = ()
    """What the request allows but the user should know (a long signal lead)."""
    launch: tuple | None = None
    """What the job runs once, in its own shell, instead of starting ``command`` on every
    rank with the system's launcher: the program and its arguments as words
    (``shell.literal``/``word``; ``Var("RUN_DIR")``, ``Var("PYTHON")`` are the job's).
    ``hpctrain scale run --one-job`` runs the study runner so, which launches each point
    itself. Rendered through ``shell.render_word`` like every other word."""

    @property
    def mpi_plugin(self) -> str | None:
        """The ``--mpi=`` plugin of the launch line (``auto``: chosen in the job)."""
        return self.srun_mpi or self.system.launch.srun_mpi

    def argv(self) -> list[str]:
        """The ``hpctrain jobscript`` command line that makes this script."""
        a = ["hpctrain", "jobscript", "--system", self.system.source, "--nodes", str(self.nodes)]
        for flag, value in (("--walltime", self.walltime), ("--queue", self.queue),
                            ("--account", self.account)):
            if value:
                a += [flag, value]
        if self.job_name != DEFAULT_JOB_NAME:
            a += ["--job-name", self.job_name]
        if self.filesystems:
            a += ["--filesystems", ":".join(self.filesystems)]
        if self.ranks_per_node:
            a += ["--ranks-per-node", str(self.ranks_per_node)]
        if self.srun_mpi:
            a += ["--srun-mpi", self.srun_mpi]
        if self.array:
            a += ["--array", self.array]
        if self.profiler:
            a += ["--profiler", self.profiler]
        a += ["--venv", self.venv or "none"]
        if self.setup_file:
            a += ["--setup", self.setup_file]
        if self.run_dir:
            a += ["--run-dir", self.run_dir]
        elif self.run_root != DEFAULT_RUN_ROOT:
            a += ["--run-root", self.run_root]
        if self.stop_exit_code != STOP_EXIT_CODE:
            a += ["--stop-exit-code", str(self.stop_exit_code)]
        if not self.check_queue:
            a.append("--no-queue-check")
        for key, value in self.env:
            a += ["--env", f"{key}={value}"]
        return a + ["--", *self.command]


def active_venv() -> str | None:
    """The virtual environment this Python runs in, if any (the default ``--venv``)."""
    return sys.prefix if sys.prefix != sys.base_prefix else None


def build_spec(*, system: str | None, command: list[str], nodes: int | None = None,
               walltime: str | None = None, queue: str | None = None,
               account: str | None = None, job_name: str | None = None,
               filesystems: list[str] | None = None, env: list[str] | None = None,
               array: str | None = None, profiler: str | None = None,
               ranks_per_node: int | None = None, venv: str | None = None,
               setup_file: str | None = None, run_root: str | None = None,
               check_queue: bool = True, srun_mpi: str | None = None,
               launch: tuple | None = None, run_dir: str | None = None,
               stop_exit_code: int | None = None) -> JobSpec:
    """The job ``hpctrain jobscript`` describes, every option checked in turn against
    the system; the first problem is one ``JobError`` naming the fix."""
    if not system:
        raise JobError("name the system: --system polaris (or aurora, perlmutter, frontier, "
                       "pbs, slurm, local, or a .toml file); see --list-systems")
    sys_ = job_system(system)
    n_nodes = validate.nodes(1 if nodes is None else nodes)
    _check_batch_options(sys_, n_nodes, walltime=walltime, queue=queue, account=account,
                         array=array, filesystems=filesystems)
    walltime_s, name_, fs = _batch_request(sys_, n_nodes, walltime=walltime, queue=queue,
                                           account=account, job_name=job_name,
                                           filesystems=filesystems, array=array,
                                           check_queue=check_queue)
    _check_launch_options(sys_, profiler=profiler, ranks_per_node=ranks_per_node,
                          srun_mpi=srun_mpi)
    env_pairs = tuple(validate.env_pair(e) for e in env or ())
    venv = active_venv() if venv is None else (None if venv == "none" else venv)
    for what, value in (("--venv", venv), ("--run-root", run_root), ("--system", system)):
        if value:
            validate.no_nul(value, what)
    validate.run_dir(run_dir, run_root=run_root, array=bool(array))
    stop_exit_code = validate.exit_code(
        STOP_EXIT_CODE if stop_exit_code is None else stop_exit_code)
    setup = _read_setup(setup_file) if setup_file else None
    if launch is not None:
        launch = tuple(launch)
        for part in (p for w in launch for p in w if isinstance(p, str)):
            validate.no_nul(part, "the launch line")
    per_node = ranks_per_node or sys_.launch.ranks_per_node  # 0: one per core, not known here
    check_command(command, array=bool(array), forbid={"train.out_dir": OUT_DIR_REASON},
                  ranks=n_nodes * per_node if per_node else None)
    spec = JobSpec(system=sys_, nodes=n_nodes,
                   walltime=validate.format_walltime(walltime_s) if walltime_s else None,
                   queue=queue, account=account, job_name=name_, filesystems=tuple(fs),
                   env=env_pairs, array=array, profiler=profiler, ranks_per_node=ranks_per_node,
                   venv=venv, setup_file=setup_file, setup=setup,
                   run_root=run_root or DEFAULT_RUN_ROOT, command=tuple(command),
                   check_queue=check_queue, srun_mpi=srun_mpi, launch=launch,
                   run_dir=run_dir, stop_exit_code=stop_exit_code,
                   warnings=validate.signal_lead(sys_.batch.directives, walltime_s)
                   + data_warnings(command, array=bool(array)))
    placement(sys_, ranks_per_node)  # ranks per node vs. cores and sockets
    return spec


def _check_batch_options(sys_: System, n_nodes: int, *, walltime, queue, account, array,
                         filesystems) -> None:
    """Options a machine without a batch system cannot take, and the ones the system's
    scheduler requires (``[batch] requires``: an account, a queue, a walltime)."""
    name, batch = sys_.name, sys_.batch
    if batch.scheduler == "none":
        given = [f for f, v in (("--walltime", walltime), ("--queue", queue),
                                ("--account", account), ("--array", array),
                                ("--filesystems", filesystems)) if v]
        if given:
            raise JobError(f"{name} has no batch system; drop {', '.join(given)}")
        if n_nodes != 1:
            raise JobError(f"{name} is one machine; use --nodes 1 or a cluster system")
    queues = "; ".join(q.describe() for q in batch.queues.values())
    hints = {
        "account": f"--account PROJECT (the allocation {name} charges)",
        "queue": "--queue NAME" + (f" (one of: {queues})" if queues else ""),
        "walltime": "--walltime HH:MM:SS (e.g. 00:30:00)",
    }
    values = {"account": account, "queue": queue, "walltime": walltime}
    for field in batch.requires:
        if not values.get(field):
            raise JobError(f"{name} needs {hints.get(field, '--' + field)}")


def _batch_request(sys_: System, n_nodes: int, *, walltime, queue, account, job_name,
                   filesystems, array, check_queue: bool) -> tuple:
    """Checks the batch directives' values (against the queue's limits unless
    ``check_queue`` is off); returns the walltime in seconds (None: not given), the job
    name and the file systems the job needs."""
    name, batch = sys_.name, sys_.batch
    walltime_s = validate.parse_walltime(walltime) if walltime else None
    if queue:
        validate.queue_name(queue)
    if account:
        validate.account(account)
    name_ = validate.job_name(job_name or DEFAULT_JOB_NAME)
    known_queue = batch.queues.get(queue) if queue else None
    if queue and batch.queues and check_queue:
        validate.queue_limits(name, batch.queues, queue, n_nodes, walltime_s)
    fs = validate.filesystems(name, batch.filesystems, filesystems) if filesystems \
        else batch.default_filesystems
    if array:
        limit = known_queue.array_throttle if known_queue and check_queue else None
        validate.array(batch.scheduler, array, limit, f"{name} queue {queue}")
    return walltime_s, name_, fs


def _check_launch_options(sys_: System, *, profiler, ranks_per_node, srun_mpi) -> None:
    """Options of the launch line: a profiler the system offers, a rank count, an
    ``srun --mpi=`` plugin where the launcher takes one."""
    name, la = sys_.name, sys_.launch
    if profiler and profiler not in la.profilers:
        raise JobError(f"--profiler {profiler} is not available on {name}; available: "
                       f"{', '.join(la.profilers) or 'none'}")
    if ranks_per_node is not None:
        validate.ranks_per_node(ranks_per_node)
    if srun_mpi is not None:
        check_srun_mpi(srun_mpi)
        if not la.uses_srun_mpi:
            raise JobError(f"--srun-mpi: the launcher of {name} ({la.launcher[0]}) has no "
                           "--mpi= plugin to choose; drop --srun-mpi (or add --mpi={srun_mpi} "
                           "to the launcher of your own system file)")


def _read_setup(setup_file: str) -> tuple:
    """``--setup FILE``: its commands, without blank lines and comments."""
    try:
        text = Path(setup_file).read_text()
    except OSError as e:
        raise JobError(f"--setup {setup_file}: cannot read it ({e.strerror})") from None
    return tuple(line.strip() for line in text.splitlines()
                 if line.strip() and not line.strip().startswith("#"))
