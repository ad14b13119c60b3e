"""The launch line: one function builds it for job scripts and for ``hpctrain launch``.

    mpiexec -n 8 --ppn 4 --depth=8 --cpu-bind depth \\            (the system's launcher)
        python -m hpctrain.jobs.bind --device-env CUDA_VISIBLE_DEVICES ... -- \\  (per rank)
        python -m hpctrain train RECIPE [overrides]                  (the program)

``launch_line`` returns words that may hold shell variables (a job script only learns its
node count inside the job) or plain strings (``hpctrain launch`` reads the allocation
first), so the script and the command can never disagree about flags. ``hpctrain
launch`` finds the allocation from PBS's or Slurm's variables, else uses this machine.
How the allocation and the rank count are read: docs/design/job-scripts.md ("``hpctrain launch``").
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import JobError
from hpctrain.jobs.shell import Word, expand, literal, resolve_word
from hpctrain.systems.registry import System


# Open MPI's mpirun answers SIGTERM (walltime, scancel, qdel, Ctrl-C) with SIGTERM to the
# ranks and SIGKILL this many seconds later (odls_base_sigkill_timeout, default 1): 10 s
# lets a stop's save finish (PBS's own SIGKILL comes after its 10 s kill_delay anyway). The
# cost: an Open MPI job that fails ends up to this long per rank of a node later.
# Other MPIs ignore the variable. Measured: docs/design/job-scripts.md ("Open MPI").
OMPI_SIGKILL_ENV = "OMPI_MCA_odls_base_sigkill_timeout"
OMPI_SIGKILL_S = 10


@dataclass(frozen=True)
class Placement:
    """How ranks sit on a node: counts, CPUs per rank, threads, explicit CPU list."""

    ranks_per_node: int | None
    """None: decided inside the job (one per core, local system only)."""
    cpus_per_rank: int | None
    threads_per_rank: int | None
    cpu_list: str | None


def placement(system: System, ranks_per_node: int | None = None,
              source: str | None = None) -> Placement:
    """``source``: where ``ranks_per_node`` came from when the user did not pass it (the
    allocation), so that an error names what to change."""
    name, la = system.name, system.launch
    rpn = ranks_per_node or la.ranks_per_node or None
    if rpn is not None and rpn < 1:
        raise JobError(f"--ranks-per-node {rpn}: use at least 1")
    if rpn is not None and la.max_ranks_per_node and rpn > la.max_ranks_per_node:
        asked = source or f"--ranks-per-node {rpn}"
        raise JobError(f"{asked}: a {name} node takes at most "
                       f"{la.max_ranks_per_node} ranks (one per GPU); "
                       + (f"ask the allocation for {la.max_ranks_per_node} tasks per node "
                          f"or fewer, or pass --ranks-per-node {la.max_ranks_per_node}"
                          if source else
                          f"use --ranks-per-node {la.max_ranks_per_node} or fewer"))
    if not la.cpus_per_node or rpn is None:
        return Placement(rpn, None, None, None)
    if rpn > la.cpus_per_node:
        raise JobError(f"--ranks-per-node {rpn} is more than the {la.cpus_per_node} CPUs "
                       f"of a {name} node; use at most {la.cpus_per_node}")
    cpus = la.cpus_per_node // rpn
    threads = max(1, cpus // la.threads_per_core)
    cpu_list = None
    if la.cpu_sockets:
        cpu_list, threads = _cpu_list(system, rpn)
    return Placement(rpn, cpus, threads, cpu_list)


def _cpu_list(system: System, rpn: int) -> tuple[str, int]:
    """``list:1-8:9-16:...``: equal blocks of cores per rank, filled socket by socket.

    No block crosses a socket and reserved cores (outside ``cpu_sockets``) stay free
    (Aurora: cores 0 and 52 belong to the OS)."""
    sockets = system.launch.cpu_sockets
    if rpn % len(sockets):
        raise JobError(f"--ranks-per-node {rpn}: on {system.name} ranks split evenly over "
                       f"{len(sockets)} sockets; use a multiple of {len(sockets)}")
    per_socket = rpn // len(sockets)
    width = min((last - first + 1) // per_socket for first, last in sockets)
    if width < 1:
        raise JobError(f"--ranks-per-node {rpn} leaves no core per rank on {system.name}")
    blocks = []
    for first, _ in sockets:
        for i in range(per_socket):
            lo = first + i * width
            blocks.append(f"{lo}-{lo + width - 1}" if width > 1 else f"{lo}")
    return "list:" + ":".join(blocks), width


@dataclass(frozen=True)
class LaunchLine:
    launcher: tuple
    """The system's launcher and its flags (mpiexec/srun)."""
    wrapper: tuple
    """``python -m hpctrain.jobs.bind ... --`` when ranks need a device or a profiler."""
    program: tuple
    """``python -m hpctrain train RECIPE [overrides]``."""

    @property
    def words(self) -> tuple:
        return self.launcher + self.wrapper + self.program

    def argv(self, values: dict[str, str] | None = None) -> list[str]:
        return [resolve_word(w, values) for w in self.words]


def launch_line(system: System, place: Placement, *, nodes: Word, ranks: Word,
                python: Word, command: list[Word], nodefile: Word | None = None,
                ranks_per_node: Word | None = None, profiler: str | None = None,
                profile_dir: Word | None = None, srun_mpi: Word | None = None) -> LaunchLine:
    """The launch line of ``command`` (hpctrain's arguments, as words) on ``system``."""
    la = system.launch
    values: dict[str, Word | None] = {
        "nodes": nodes, "ranks": ranks, "nodefile": nodefile, "srun_mpi": srun_mpi,
        "ranks_per_node": ranks_per_node or (literal(str(place.ranks_per_node))
                                             if place.ranks_per_node else None),
        "gpus_per_node": literal(str(la.gpus_per_node)),
        "cpus_per_rank": literal(str(place.cpus_per_rank)) if place.cpus_per_rank else None,
        "cpu_list": literal(place.cpu_list) if place.cpu_list else None,
    }
    launcher = []
    for template in la.launcher:
        missing = [k for k, v in values.items() if v is None and "{" + k + "}" in template]
        if missing:
            raise JobError(f"system file {system.file}: launcher argument {template!r} "
                           f"needs {', '.join(missing)}, which this system does not define")
        launcher.append(expand(template, {k: v for k, v in values.items() if v is not None}))
    wrapper: list[Word] = []
    if profiler and profiler not in la.profilers:
        raise JobError(f"--profiler {profiler} is not available on {system.name}; "
                       f"available: {', '.join(la.profilers) or 'none'}")
    gpu_rule = la.device_env and la.gpus_per_node
    if gpu_rule or profiler:
        wrapper += [python, literal("-m"), literal("hpctrain.jobs.bind")]
        if gpu_rule:
            wrapper += [literal(a) for a in ("--device-env", la.device_env, "--devices",
                                             str(la.gpus_per_node), "--order",
                                             la.device_order)]
        if profiler:
            wrapper += [literal(f"--{profiler}-dir"), profile_dir or literal(profiler)]
        wrapper.append(literal("--"))
    program = [python, literal("-m"), literal("hpctrain"), *command]
    return LaunchLine(tuple(launcher), tuple(wrapper), tuple(program))


# ----------------------------------------------------------------------- inside a job

@dataclass(frozen=True)
class Allocation:
    scheduler: str
    """``pbs``, ``slurm`` or ``none``."""
    nodes: int
    job_id: str | None
    nodefile: str | None
    ranks: int | None = None
    """Rank slots the allocation was sized for (None: it does not say)."""
    ranks_per_node: int | None = None


def detect_allocation(env: dict | None = None) -> Allocation:
    env = os.environ if env is None else env
    if env.get("PBS_JOBID"):
        nodefile = env.get("PBS_NODEFILE", "")
        try:
            hosts = {h.strip() for h in Path(nodefile).read_text().splitlines() if h.strip()}
        except OSError as e:
            raise JobError(f"PBS_JOBID is set but PBS_NODEFILE ({nodefile or 'unset'}) cannot "
                           f"be read ({e.strerror}); run inside the job's shell") from None
        if not hosts:
            raise JobError(f"PBS_NODEFILE {nodefile} lists no hosts")
        ranks, rpn = _pbs_slots(Path(nodefile).read_text().split(), len(hosts))
        return Allocation("pbs", len(hosts), env["PBS_JOBID"], nodefile, ranks, rpn)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if job_id:
        count = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
        if not count or not count.isdigit() or int(count) < 1:
            raise JobError("SLURM_JOB_ID is set but SLURM_JOB_NUM_NODES/SLURM_NNODES is not a "
                           "node count; run inside the job's shell (salloc/sbatch)")
        ranks, rpn = _slurm_tasks(env, int(count))
        return Allocation("slurm", int(count), job_id, None, ranks, rpn)
    return Allocation("none", 1, None, None)


def _pbs_slots(lines: list[str], n_hosts: int) -> tuple[int | None, int | None]:
    """``mpiprocs`` > 1 on every host: the nodefile names each host once per slot. One
    line per host (PBS's default, Polaris and Aurora) says nothing about ranks, and an
    uneven file cannot be spelled as ``--ppn``: then the system decides."""
    if len(lines) <= n_hosts or len(lines) % n_hosts:
        return None, None
    return len(lines), len(lines) // n_hosts


def _slurm_tasks(env, n_nodes: int) -> tuple[int | None, int | None]:
    """``SLURM_NTASKS`` is set when the allocation asked for tasks (``-n``,
    ``--ntasks-per-node``); ``SLURM_NTASKS_PER_NODE`` only with ``--ntasks-per-node``."""
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS") or ""
    if not ntasks.isdigit() or int(ntasks) < 1:
        return None, None
    per_node = env.get("SLURM_NTASKS_PER_NODE", "")
    rpn = int(per_node) if per_node.isdigit() and int(per_node) > 0 else \
        -(-int(ntasks) // n_nodes)
    return int(ntasks), rpn


def local_ranks() -> int:
    """Ranks on this machine when nothing says otherwise: one per CPU core we may use."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def plan_launch(system: System, alloc: Allocation, command: list[str], *,
                nodes: int | None = None, ranks_per_node: int | None = None,
                ranks: int | None = None, profiler: str | None = None,
                python: str = sys.executable, srun_mpi: str | None = None) -> list[str]:
    """The argv ``hpctrain launch`` runs for ``command`` in allocation ``alloc``."""
    scheduler = system.batch.scheduler
    if scheduler != "none" and alloc.scheduler != scheduler and nodes is None:
        inside = {"pbs": "qsub -I", "slurm": "salloc"}[scheduler]
        raise JobError(f"{system.name} runs under {scheduler.upper()}, but this shell "
                       f"is not in a {scheduler.upper()} job; run inside one (e.g. "
                       f"{inside}) or pass --nodes N with --dry-run to preview")
    if ranks is not None and scheduler != "none":
        raise JobError(f"--ranks is for the local system; on {system.name} the rank count is "
                       "nodes x --ranks-per-node")
    n_nodes = nodes or alloc.nodes
    total = source = None
    if ranks is not None:
        ranks_per_node = ranks
    elif ranks_per_node is None and nodes is None and alloc.ranks:
        ranks_per_node, total = alloc.ranks_per_node, alloc.ranks  # the allocation's tasks
        source = (f"the allocation's {ranks_per_node} tasks per node ({alloc.ranks} on "
                  f"{alloc.nodes} node(s))")
    place = placement(system, ranks_per_node, source)
    rpn = place.ranks_per_node or local_ranks()
    place = Placement(rpn, place.cpus_per_rank, place.threads_per_rank, place.cpu_list)
    total = total or n_nodes * rpn
    plugin = srun_mpi or system.launch.srun_mpi
    if plugin == "auto" and system.launch.uses_srun_mpi:
        plugin = _detect_srun_mpi(python)
    out_dir = next((c.split("=", 1)[1] for c in command
                    if c.startswith("--train.out_dir=")), None)
    line = launch_line(system, place, nodes=literal(str(n_nodes)),
                       ranks=literal(str(total)), python=literal(python),
                       srun_mpi=literal(plugin) if plugin else None,
                       command=[literal(c) for c in command],
                       nodefile=literal(alloc.nodefile) if alloc.nodefile else None,
                       profiler=profiler,
                       profile_dir=literal(f"{out_dir}/{profiler}") if out_dir and profiler
                       else None)
    argv = line.argv()
    if scheduler == "none":
        argv[0] = _local_program(argv[0], python)
    return argv


def _detect_srun_mpi(python: str) -> str:
    """``srun_mpi = "auto"``: ask ``hpctrain.jobs.srun_mpi`` in a subprocess (it loads the
    MPI library; this process must not)."""
    p = subprocess.run([python, "-m", "hpctrain.jobs.srun_mpi"], capture_output=True,
                       text=True, timeout=120)
    plugin = p.stdout.strip()
    if p.returncode != 0 or not plugin:
        raise JobError(f"cannot choose srun's MPI plugin ({p.stderr.strip()[-300:]}); "
                       "name it with --srun-mpi pmi2 (or pmix; see `srun --mpi=list`)")
    print(p.stderr.strip(), file=sys.stderr, flush=True)
    return plugin


def _local_program(program: str, python: str) -> str:
    """On this machine prefer the launcher next to Python (the ``mpich`` wheel's mpiexec,
    which matches mpi4py) over whatever is first on PATH."""
    sibling = Path(python).parent / program
    return str(sibling) if "/" not in program and sibling.exists() else program


def run_launch(argv: list[str], dry_run: bool = False) -> int:
    """Print the launch line; unless ``dry_run``, run it and return its exit status."""
    print("+ " + shlex.join(argv), flush=True)
    if dry_run:
        return 0
    try:
        rc = subprocess.call(argv, env={OMPI_SIGKILL_ENV: str(OMPI_SIGKILL_S), **os.environ})
    except FileNotFoundError:
        raise JobError(f"launcher {argv[0]!r} not found on PATH; load the system's MPI "
                       "module (or activate the environment that has mpiexec)") from None
    return 128 - rc if rc < 0 else rc
