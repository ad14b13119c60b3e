"""System profiles: what a batch job needs to know about a machine, as data.

Each profile is a TOML file in ``hpctrain/jobs/profiles/`` (polaris, aurora, perlmutter,
frontier, and the generic pbs, slurm and local). ``--system`` takes one of those names or
the path of your own TOML file: copy the closest profile and edit it.

Fields (see polaris.toml for a commented example):

- ``scheduler``: ``pbs``, ``slurm`` or ``none``.
- ``ranks_per_node``, ``gpus_per_node``; ``cpus_per_node`` (CPUs the launcher hands out,
  hardware threads on SLURM) and ``threads_per_core``; a rank gets
  ``cpus_per_node // ranks_per_node`` CPUs and as many OpenMP threads as whole cores.
- ``cpu_sockets``: core ranges ``[first, last]`` per socket for explicit CPU lists
  (Aurora), so that no rank crosses a socket or touches a reserved core.
- ``device_env``, ``device_order``: which variable selects a rank's GPU before MPI
  starts (``CUDA_VISIBLE_DEVICES``, ``ZE_AFFINITY_MASK``) and how (``direct``:
  local_rank % gpus, ``reverse``: gpus - 1 - local_rank % gpus).
- ``setup``: shell commands (module loads) run in order, each checked; ``[env]``:
  variables exported for the run (GPU-aware MPI). Both can be overridden per job.
- ``directives``, ``launcher``: templates with ``{placeholders}`` (see ``PLACEHOLDERS``).
- ``srun_mpi``: the ``--mpi=`` plugin for ``{srun_mpi}`` in the launcher (``pmi2``,
  ``pmix``, ...), or ``auto``: chosen inside the job for the MPI library mpi4py loads
  (``srun_mpi.py``). ``--srun-mpi`` overrides it per job.
- ``max_ranks_per_node``: a hard limit below the CPU count (Frontier: one rank per GCD).
- ``[queues.NAME]``: ``nodes = [min, max]``, ``walltime``, optional ``min_walltime``,
  ``walltime_by_nodes`` (``[[max_nodes, walltime], ...]``), ``directives``,
  ``array_throttle``, and ``partition``: what ``{queue}`` becomes in the directives when
  the queue is not a partition of its own (Frontier's ``debug`` is a QOS of ``batch``).
- ``filesystems``, ``default_filesystems``, ``requires``, ``profilers``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hpctrain.errors import JobError
from hpctrain.jobs import validate
from hpctrain.jobs.shell import placeholders

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCHEDULERS = ("pbs", "slurm", "none")
DIRECTIVE_PLACEHOLDERS = {"job_name", "account", "queue", "nodes", "walltime", "filesystems",
                          "ranks_per_node", "gpus_per_node", "cpus_per_rank"}
LAUNCHER_PLACEHOLDERS = {"nodes", "ranks", "ranks_per_node", "gpus_per_node", "cpus_per_rank",
                         "cpu_list", "nodefile", "srun_mpi"}
_SRUN_MPI = re.compile(r"[a-z][a-z0-9_]{0,31}")
PLACEHOLDERS = DIRECTIVE_PLACEHOLDERS | LAUNCHER_PLACEHOLDERS


@dataclass(frozen=True)
class Queue:
    name: str
    min_nodes: int
    max_nodes: int
    max_walltime: int
    """Seconds."""
    walltime_by_nodes: tuple = ()
    """``((max_nodes, seconds), ...)``: a tighter walltime limit for smaller jobs."""
    directives: tuple = ()
    """Extra directives this queue needs (Polaris preemptable: ``-r y``)."""
    array_throttle: int | None = None
    """Job arrays must carry a ``%N`` throttle with N at most this (Polaris prod: 10)."""
    min_walltime: int = 0
    """Seconds; shorter requests are refused (every ALCF queue: 5 minutes)."""
    partition: str | None = None
    """The value of ``{queue}`` in directives, when not the queue's own name."""

    def max_walltime_for(self, n_nodes: int) -> int:
        for max_nodes, seconds in self.walltime_by_nodes:
            if n_nodes <= max_nodes:
                return seconds
        return self.max_walltime

    def describe(self) -> str:
        nodes = f"{self.min_nodes}-{self.max_nodes} nodes"
        return f"{self.name} ({nodes}, <= {validate.format_walltime(self.max_walltime)})"


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    scheduler: str
    ranks_per_node: int
    """0: one rank per CPU core of the machine (local only)."""
    gpus_per_node: int
    cpus_per_node: int
    """0: unknown (no CPU binding, no OMP_NUM_THREADS)."""
    threads_per_core: int
    cpu_sockets: tuple
    device_env: str | None
    device_order: str | None
    requires: tuple
    filesystems: tuple
    default_filesystems: tuple
    profilers: tuple
    setup: tuple
    env: tuple
    """``((KEY, VALUE), ...)`` in file order."""
    directives: tuple
    launcher: tuple
    queues: dict
    source: str
    """Where the profile came from (a built-in name or a file path)."""
    srun_mpi: str | None = None
    """``--mpi=`` plugin for ``{srun_mpi}``: a name, or ``auto`` (chosen in the job)."""
    max_ranks_per_node: int | None = None

    @property
    def uses_srun_mpi(self) -> bool:
        return any("{srun_mpi}" in t for t in self.launcher)

    @property
    def directive_prefix(self) -> str:
        return {"pbs": "#PBS", "slurm": "#SBATCH"}.get(self.scheduler, "")


def profile_names() -> list[str]:
    root = resources.files("hpctrain.jobs") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or your own TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or "/" in name_or_path:
        if not path.is_file():
            raise JobError(f"system profile {path} does not exist; give a built-in system "
                           f"({', '.join(profile_names())}) or an existing .toml file")
        text, name = path.read_text(), path.stem
    else:
        resource = resources.files("hpctrain.jobs") / "profiles" / f"{name_or_path}.toml"
        if not resource.is_file():
            raise JobError(f"unknown system {name_or_path!r}; built-in systems: "
                           f"{', '.join(profile_names())} (or the path of a .toml profile; "
                           "see `hpctrain jobscript --list-systems`)")
        text, name = resource.read_text(), name_or_path
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise JobError(f"system profile {name_or_path} is not valid TOML: {e}") from None
    return _profile_from_dict(name, data, source=name_or_path)


def _profile_from_dict(name: str, d: dict, source: str) -> Profile:
    def need(key, typ, default=None):
        if key not in d:
            if default is not None:
                return default
            raise JobError(f"system profile {source} lacks {key!r}; see "
                           "hpctrain/jobs/profiles/polaris.toml for every field")
        value = d[key]
        if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
            raise JobError(f"system profile {source}: {key} must be {typ.__name__}")
        return value

    known = {"description", "scheduler", "ranks_per_node", "gpus_per_node", "cpus_per_node",
             "threads_per_core", "cpu_sockets", "device_env", "device_order", "requires",
             "filesystems", "default_filesystems", "profilers", "setup", "env", "directives",
             "launcher", "queues", "srun_mpi", "max_ranks_per_node"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise JobError(f"system profile {source} has unknown field(s) {', '.join(unknown)}; "
                       f"fields are {', '.join(sorted(known))}")
    scheduler = need("scheduler", str)
    if scheduler not in SCHEDULERS:
        raise JobError(f"system profile {source}: scheduler must be one of {', '.join(SCHEDULERS)}")
    queues = {}
    for qname, q in need("queues", dict, {}).items():
        validate.queue_name(qname)
        try:
            lo, hi = q["nodes"]
            queues[qname] = Queue(
                name=qname, min_nodes=int(lo), max_nodes=int(hi),
                max_walltime=validate.parse_walltime(q["walltime"]),
                walltime_by_nodes=tuple((int(n), validate.parse_walltime(w))
                                        for n, w in q.get("walltime_by_nodes", ())),
                directives=tuple(q.get("directives", ())),
                array_throttle=q.get("array_throttle"),
                min_walltime=validate.parse_walltime(q["min_walltime"])
                if "min_walltime" in q else 0,
                partition=validate.queue_name(q["partition"]) if "partition" in q else None)
        except (KeyError, TypeError, ValueError) as e:
            raise JobError(f"system profile {source}: [queues.{qname}] needs nodes = [min, max] "
                           f"and walltime = \"HH:MM:SS\" ({type(e).__name__}: {e})") from None
    profile = Profile(
        name=name, description=need("description", str), scheduler=scheduler,
        ranks_per_node=need("ranks_per_node", int), gpus_per_node=need("gpus_per_node", int),
        cpus_per_node=need("cpus_per_node", int), threads_per_core=need("threads_per_core", int, 1),
        cpu_sockets=tuple(tuple(s) for s in need("cpu_sockets", list, [])),
        device_env=d.get("device_env"), device_order=d.get("device_order"),
        requires=tuple(need("requires", list, [])),
        filesystems=tuple(need("filesystems", list, [])),
        default_filesystems=tuple(need("default_filesystems", list, [])),
        profilers=tuple(need("profilers", list, [])), setup=tuple(need("setup", list, [])),
        env=tuple((str(k), str(v)) for k, v in need("env", dict, {}).items()),
        directives=tuple(need("directives", list, [])), launcher=tuple(need("launcher", list)),
        queues=queues, source=source, srun_mpi=d.get("srun_mpi"),
        max_ranks_per_node=need("max_ranks_per_node", int) if "max_ranks_per_node" in d
        else None)
    _check_templates(profile)
    return profile


def _check_templates(p: Profile) -> None:
    for t in p.directives + tuple(d for q in p.queues.values() for d in q.directives):
        bad = placeholders(t) - DIRECTIVE_PLACEHOLDERS
        if bad:
            raise JobError(f"system profile {p.source}: directive {t!r} uses unknown "
                           f"placeholder(s) {', '.join(sorted(bad))}; known: "
                           f"{', '.join(sorted(DIRECTIVE_PLACEHOLDERS))}")
    for t in p.launcher:
        bad = placeholders(t) - LAUNCHER_PLACEHOLDERS
        if bad:
            raise JobError(f"system profile {p.source}: launcher argument {t!r} uses unknown "
                           f"placeholder(s) {', '.join(sorted(bad))}; known: "
                           f"{', '.join(sorted(LAUNCHER_PLACEHOLDERS))}")
    if not p.launcher:
        raise JobError(f"system profile {p.source}: launcher must name a program")
    if p.srun_mpi is not None:
        srun_mpi(p.srun_mpi, f"system profile {p.source}: srun_mpi")
    if p.device_order not in (None, "direct", "reverse"):
        raise JobError(f"system profile {p.source}: device_order must be direct or reverse")
    if bool(p.device_env) != bool(p.device_order):
        raise JobError(f"system profile {p.source}: set device_env and device_order together")
    for key, _ in p.env:
        validate.env_pair(f"{key}=")
    for fs in p.default_filesystems:
        if fs not in p.filesystems:
            raise JobError(f"system profile {p.source}: default filesystem {fs} is not listed "
                           "in filesystems")


def describe_systems() -> str:
    """The table printed by ``hpctrain jobscript --list-systems``."""
    lines = []
    for name in profile_names():
        p = load_profile(name)
        rpn = p.ranks_per_node or "cores"
        lines.append(f"{name:<11} {p.scheduler:<5} ranks/node {rpn:<5} GPUs/node "
                     f"{p.gpus_per_node:<3} {p.description}")
        if p.queues:
            lines.append(f"{'':<12}queues: " + "; ".join(q.describe() for q in p.queues.values()))
        if p.filesystems:
            lines.append(f"{'':<12}filesystems: {', '.join(p.filesystems)} (default "
                         f"{':'.join(p.default_filesystems) or 'none'})")
        if p.requires:
            lines.append(f"{'':<12}requires: " + ", ".join(f"--{r.replace('_', '-')}"
                                                           for r in p.requires))
    return "\n".join(lines)


def srun_mpi(value: str, what: str = "--srun-mpi") -> str:
    """An ``srun --mpi=`` plugin name (``pmi2``, ``pmix``, ``pmix_v4``, ``cray_shasta``,
    ``none``) or ``auto``."""
    if not isinstance(value, str) or not _SRUN_MPI.fullmatch(value):
        raise JobError(f"{what} {value!r} is not an srun MPI plugin name; use auto, pmi2, "
                       "pmix, cray_shasta or none (see `srun --mpi=list`)")
    return value
