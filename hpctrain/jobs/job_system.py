"""A system as a batch job sees it: the checks of its ``[batch]`` and ``[launch]`` tables.

Systems are read by ``hpctrain.systems.registry.load_system``
(``hpctrain/systems/<name>.toml``, or the path of your own file; the fields are described
there). ``job_system`` adds what needs the job generator's vocabulary: the
``{placeholders}`` a directive or launcher template may use, queue and partition names a
directive can carry, environment keys, and the ``srun --mpi=`` plugin name.
"""

from __future__ import annotations

import re

from hpctrain.errors import JobError
from hpctrain.jobs import validate
from hpctrain.jobs.shell import placeholders
from hpctrain.sizes import GiB
from hpctrain.systems.registry import System, load_system, system_names

DIRECTIVE_PLACEHOLDERS = {"job_name", "account", "queue", "nodes", "walltime", "filesystems",
                          "ranks_per_node", "gpus_per_node", "cpus_per_rank"}
LAUNCHER_PLACEHOLDERS = {"nodes", "ranks", "ranks_per_node", "gpus_per_node", "cpus_per_rank",
                         "cpu_list", "nodefile", "srun_mpi"}
_SRUN_MPI = re.compile(r"[a-z][a-z0-9_]{0,31}")
PLACEHOLDERS = DIRECTIVE_PLACEHOLDERS | LAUNCHER_PLACEHOLDERS


def job_system(name_or_path: str) -> System:
    """The system ``--system`` names, checked for job scripts and ``hpctrain launch``."""
    system = load_system(name_or_path)
    _check(system)
    return system


def _check(s: System) -> None:
    b, la = s.batch, s.launch
    where = f"system file {s.file}"
    for name, queue in b.queues.items():
        validate.queue_name(name)
        if queue.partition is not None:
            validate.queue_name(queue.partition)
    for t in b.directives + tuple(d for q in b.queues.values() for d in q.directives):
        bad = placeholders(t) - DIRECTIVE_PLACEHOLDERS
        if bad:
            raise JobError(f"{where}: directive {t!r} uses unknown placeholder(s) "
                           f"{', '.join(sorted(bad))}; known: "
                           f"{', '.join(sorted(DIRECTIVE_PLACEHOLDERS))}")
    for t in la.launcher:
        bad = placeholders(t) - LAUNCHER_PLACEHOLDERS
        if bad:
            raise JobError(f"{where}: launcher argument {t!r} uses unknown placeholder(s) "
                           f"{', '.join(sorted(bad))}; known: "
                           f"{', '.join(sorted(LAUNCHER_PLACEHOLDERS))}")
    if la.srun_mpi is not None:
        srun_mpi(la.srun_mpi, f"{where}: [launch] srun_mpi")
    for key, _ in la.env:
        validate.env_pair(f"{key}=")


def describe_systems() -> str:
    """The table printed by ``hpctrain jobscript --list-systems``."""
    lines = []
    for name in system_names():
        s = job_system(name)
        b, la = s.batch, s.launch
        rpn = la.ranks_per_node or "cores"
        lines.append(f"{name:<11} {b.scheduler:<5} ranks/node {rpn:<5} GPUs/node "
                     f"{la.gpus_per_node:<3} {s.description}")
        if b.queues:
            lines.append(f"{'':<12}queues: " + "; ".join(q.describe() for q in b.queues.values()))
        if b.filesystems:
            lines.append(f"{'':<12}filesystems: {', '.join(b.filesystems)} (default "
                         f"{':'.join(b.default_filesystems) or 'none'})")
        if b.requires:
            lines.append(f"{'':<12}requires: " + ", ".join(f"--{r.replace('_', '-')}"
                                                           for r in b.requires))
        if s.perf:
            memory = (f"{s.perf.device_memory / GiB:.0f} GiB each" if s.perf.device_memory
                      else "host memory")
            lines.append(f"{'':<12}performance model: {s.perf.device} ({memory}); "
                         "hpctrain plan and scale know it")
    return "\n".join(lines)


def srun_mpi(value: str, what: str = "--srun-mpi") -> str:
    """An ``srun --mpi=`` plugin name (``pmi2``, ``pmix``, ``pmix_v4``, ``cray_shasta``,
    ``none``) or ``auto``."""
    if not isinstance(value, str) or not _SRUN_MPI.fullmatch(value):
        raise JobError(f"{what} {value!r} is not an srun MPI plugin name; use auto, pmi2, "
                       "pmix, cray_shasta or none (see `srun --mpi=list`)")
    return value
