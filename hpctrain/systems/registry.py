"""The system registry: one TOML file per machine, read by one loader.

``hpctrain/systems/<name>.toml`` describes a machine once for every command that needs
it: ``jobscript`` and ``launch`` (batch system, launch line), ``plan`` and ``scale``
(performance model), and the MFU of ``train`` (device peaks, ``devices.toml``).
``--system NAME`` reads the same file in all of them; ``--system PATH.toml`` reads your
own. A file has a ``description`` and three tables, ``[batch]``, ``[launch]`` and an
optional ``[perf]``; ``polaris.toml`` is a commented example. The loader checks
structure and types, names the fix, and converts ``[perf]`` to SI units.
Every field: docs/design/job-scripts.md ("Your own cluster").
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from hpctrain.errors import UserError
from hpctrain.sizes import GiB, MiB
from hpctrain.systems.devices import DEVICES, device_peaks
from hpctrain.systems.perf import FileSystem, Link, SystemPerf
from hpctrain.systems.toml_table import REQUIRED, Table

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCHEDULERS = ("pbs", "slurm", "none")
"""Device peaks, next to the systems (not a system itself)."""
_WALLTIME = re.compile(r"(\d{1,4}):([0-5]\d):([0-5]\d)")


def walltime_seconds(text) -> int | None:
    """``HH:MM:SS`` (hours may exceed 24) -> seconds; None when ``text`` is not that."""
    m = _WALLTIME.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        return None
    h, mi, s = (int(g) for g in m.groups())
    return h * 3600 + mi * 60 + s


def format_walltime(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


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
        return f"{self.name} ({nodes}, <= {format_walltime(self.max_walltime)})"


@dataclass(frozen=True)
class Batch:
    """``[batch]``: what a job script asks the batch system for."""

    scheduler: str
    directives: tuple = ()
    queues: dict = field(default_factory=dict)
    """``{name: Queue}`` in file order."""
    requires: tuple = ()
    filesystems: tuple = ()
    default_filesystems: tuple = ()

    @property
    def directive_prefix(self) -> str:
        return {"pbs": "#PBS", "slurm": "#SBATCH"}.get(self.scheduler, "")


@dataclass(frozen=True)
class Launch:
    """``[launch]``: how the ranks start and where they sit on a node."""

    launcher: tuple
    ranks_per_node: int
    """0: one rank per CPU core of the machine (local only)."""
    gpus_per_node: int
    cpus_per_node: int
    """0: unknown (no CPU binding, no OMP_NUM_THREADS)."""
    threads_per_core: int = 1
    cpu_sockets: tuple = ()
    max_ranks_per_node: int | None = None
    device_env: str | None = None
    device_order: str | None = None
    setup: tuple = ()
    env: tuple = ()
    """``((KEY, VALUE), ...)`` in file order."""
    profilers: tuple = ()
    srun_mpi: str | None = None
    """``--mpi=`` plugin for ``{srun_mpi}``: a name, or ``auto`` (chosen in the job)."""
    vendor_mpi: str | None = None
    """The site's MPI (``Cray MPICH``): mpi4py is built against it (``hpctrain doctor``)."""

    @property
    def uses_srun_mpi(self) -> bool:
        return any("{srun_mpi}" in t for t in self.launcher)

    @property
    def expects_gpu_aware_mpi(self) -> bool:
        """Whether the system turns on the MPI's GPU support (Cray MPICH's
        ``MPICH_GPU_SUPPORT_ENABLED``, MPICH's ``MPIR_CVAR_ENABLE_GPU``)."""
        return any(k in ("MPICH_GPU_SUPPORT_ENABLED", "MPIR_CVAR_ENABLE_GPU") and v == "1"
                   for k, v in self.env)


@dataclass(frozen=True)
class System:
    name: str
    description: str
    source: str
    """What ``--system`` said: a built-in name or a file's path."""
    file: str
    """The file read: ``hpctrain/systems/<name>.toml`` or the path given."""
    batch: Batch
    launch: Launch
    perf: SystemPerf | None = None
    """None: the performance model knows nothing of this system."""


def _folder():
    return resources.files("hpctrain.systems")


def system_names() -> list[str]:
    """The built-in systems."""
    return sorted(p.name[:-5] for p in _folder().iterdir()
                  if p.name.endswith(".toml") and p.name != DEVICES)


def load_system(name_or_path: str) -> System:
    """A built-in system by name, or your own file by path (``.toml`` or a ``/``)."""
    if name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(f"system file {path} does not exist; give a built-in system "
                            f"({', '.join(system_names())}) or an existing .toml file (copy "
                            "one of hpctrain/systems/*.toml and edit it)")
        try:
            text = path.read_text()
        except OSError as e:
            raise UserError(f"system file {path} cannot be read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise UserError(f"system file {path} is not UTF-8 text; a system file is TOML "
                            "(copy one of hpctrain/systems/*.toml)") from None
        name, file = path.stem, str(path)
    else:
        if name_or_path not in system_names():
            raise UserError(f"unknown system {name_or_path!r}; built-in systems: "
                            f"{', '.join(system_names())} (or the path of a .toml file; "
                            "see `hpctrain jobscript --list-systems`)")
        text, name = (_folder() / f"{name_or_path}.toml").read_text(), name_or_path
        file = f"hpctrain/systems/{name}.toml"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"system file {file} is not valid TOML: {e}") from None
    return _system(name, data, name_or_path, file)


# ------------------------------------------------------------------------- reading

def _walltime(t: Table, key: str, default=REQUIRED) -> int:
    text = t.get(key, str, default)
    if text is None:
        return 0
    seconds = walltime_seconds(text)
    if not seconds:
        raise t.error(f"{t.key(key)} = {text!r} is not a walltime HH:MM:SS longer than zero")
    return seconds


def _system(name: str, data: dict, source: str, file: str) -> System:
    top = Table(data, file, "")
    description = top.get("description", str)
    batch = _batch(top.table("batch"))
    launch = _launch(top.table("launch"))
    perf_table = top.table("perf", None)
    perf = _perf(perf_table, name, description, launch, source) if perf_table else None
    top.done()
    return System(name=name, description=description, source=source, file=file, batch=batch,
                  launch=launch, perf=perf)


def _batch(t: Table) -> Batch:
    scheduler = t.get("scheduler", str)
    if scheduler not in SCHEDULERS:
        raise t.error(f"[batch] scheduler = {scheduler!r}: use one of {', '.join(SCHEDULERS)}")
    queues_table = t.table("queues", {})
    queues = {}
    for qname in queues_table.data:
        queues[qname] = _queue(qname, queues_table.table(qname))
    queues_table.done()
    batch = Batch(scheduler=scheduler, directives=t.strings("directives", ()), queues=queues,
                  requires=t.strings("requires", ()), filesystems=t.strings("filesystems", ()),
                  default_filesystems=t.strings("default_filesystems", ()))
    t.done()
    for fs in batch.default_filesystems:
        if fs not in batch.filesystems:
            raise t.error(f"default filesystem {fs} is not listed in [batch] filesystems")
    return batch


def _queue(name: str, t: Table) -> Queue:
    nodes = t.get("nodes", list)
    if len(nodes) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                  for n in nodes) or nodes[0] > nodes[1]:
        raise t.error(f"[{t.where}] nodes must be [min, max] node counts, not {nodes!r}")
    by_nodes = []
    for item in t.get("walltime_by_nodes", list, []):
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int)
                or not walltime_seconds(item[1])):
            raise t.error(f"[{t.where}] walltime_by_nodes must be [[max_nodes, \"HH:MM:SS\"], "
                          f"...], not {item!r}")
        by_nodes.append((item[0], walltime_seconds(item[1])))
    queue = Queue(name=name, min_nodes=nodes[0], max_nodes=nodes[1],
                  max_walltime=_walltime(t, "walltime"), walltime_by_nodes=tuple(by_nodes),
                  directives=t.strings("directives", ()),
                  array_throttle=t.get("array_throttle", int, None),
                  min_walltime=_walltime(t, "min_walltime", None),
                  partition=t.get("partition", str, None))
    t.done()
    return queue


def _launch(t: Table) -> Launch:
    launcher = t.strings("launcher")
    if not launcher:
        raise t.error("[launch] launcher must name a program")
    sockets = t.get("cpu_sockets", list, [])
    if not all(isinstance(s, list) and len(s) == 2 and all(isinstance(c, int) for c in s)
               and s[0] <= s[1] for s in sockets):
        raise t.error(f"[launch] cpu_sockets must be [[first, last], ...] core ranges, "
                      f"not {sockets!r}")
    env = t.table("env", {})
    for key in env.data:
        env.get(key, str)
    env.done()
    launch = Launch(
        launcher=launcher, ranks_per_node=t.get("ranks_per_node", int),
        gpus_per_node=t.get("gpus_per_node", int), cpus_per_node=t.get("cpus_per_node", int),
        threads_per_core=t.get("threads_per_core", int, 1),
        cpu_sockets=tuple(tuple(s) for s in sockets),
        max_ranks_per_node=t.get("max_ranks_per_node", int, None),
        device_env=t.get("device_env", str, None), device_order=t.get("device_order", str, None),
        setup=t.strings("setup", ()), env=tuple(env.data.items()),
        profilers=t.strings("profilers", ()), srun_mpi=t.get("srun_mpi", str, None),
        vendor_mpi=t.get("vendor_mpi", str, None))
    t.done()
    if launch.device_order not in (None, "direct", "reverse"):
        raise t.error("[launch] device_order must be direct or reverse")
    if bool(launch.device_env) != bool(launch.device_order):
        raise t.error("[launch] set device_env and device_order together")
    if launch.threads_per_core < 1:
        raise t.error("[launch] threads_per_core must be at least 1")
    return launch


def _link(t: Table) -> Link:
    """A link in the file's units (``alpha_us``, ``gbytes_per_s``), converted to SI."""
    link = Link(alpha_s=t.get("alpha_us", float) * 1e-6,
                bandwidth=t.get("gbytes_per_s", float) * 1e9)
    t.done()
    return link


def _perf(t: Table, name: str, description: str, launch: Launch, source: str) -> SystemPerf:
    device = t.get("device", str)
    compute, network = t.table("compute"), t.table("network")
    peaks = compute.numbers("peak_tflops", None)
    known = device_peaks()
    if device in known:
        if peaks is not None:
            raise t.error(f"[perf.compute] peak_tflops: the peaks of {device} are in "
                          f"hpctrain/systems/{DEVICES}; drop them here")
        peaks = known[device]
    elif peaks is None:
        raise t.error(f"[perf] device {device!r} has no peaks in hpctrain/systems/{DEVICES} "
                      f"({', '.join(known)}): name one of those, or give [perf.compute] "
                      "peak_tflops = { bf16 = ..., fp32 = ... }")
    perf = SystemPerf(
        name=name, description=description, ranks_per_node=launch.ranks_per_node,
        device=device, device_memory=t.get("device_memory_gib", float) * GiB,
        memory_reserve=t.get("memory_reserve_gib", float, 0.0) * GiB,
        cores_per_node=t.get("cores_per_node", int, 0),
        flash_attention=t.get("flash_attention", bool, False),
        base_memory=t.get("base_memory_mib", float, 0.0) * MiB,
        peak_flops={k: float(v) * 1e12 for k, v in peaks.items()},
        achieved_flops={k: float(v) * 1e12
                        for k, v in compute.numbers("achieved_tflops").items()},
        layer_overhead_s=compute.get("layer_overhead_us", float) * 1e-6,
        optimizer_s_per_param=compute.get("optimizer_ns_per_param", float) * 1e-9,
        optimizer_overhead_s=compute.get("optimizer_overhead_us", float) * 1e-6,
        memory_bandwidth=compute.get("memory_gbytes_per_s", float, 0.0) * 1e9,
        activation_passes=compute.get("activation_passes", float, 0.0),
        intra=_link(network.table("intra")), inter=_link(network.table("inter")),
        overlap=network.get("overlap", float, 0.0), xccl=_library(network),
        filesystem=_filesystem(t), source=source)
    for table in (t, compute, network):
        table.done()
    overlaps = (perf.overlap,) + ((perf.xccl[2],) if perf.xccl else ())
    if not all(0.0 <= o <= 1.0 for o in overlaps):
        raise t.error("[perf.network] overlap must be between 0 and 1")
    return perf


def _library(network: Table) -> tuple | None:
    """``[perf.network.xccl]``: the links and overlap of the GPU's collective library."""
    lib = network.table("xccl", None)
    if lib is None:
        return None
    figures = (_link(lib.table("intra")), _link(lib.table("inter")), lib.get("overlap", float))
    lib.done()
    return figures


def _filesystem(perf: Table) -> FileSystem | None:
    """``[perf.filesystem]``: where checkpoints go, in the file's units (GB/s)."""
    fs = perf.table("filesystem", None)
    if fs is None:
        return None
    rates = {k: fs.get(k, float) * 1e9 for k in ("write_gbytes_per_s", "node_write_gbytes_per_s",
                                                 "host_copy_gbytes_per_s")}
    if not all(r > 0 for r in rates.values()):
        raise fs.error("[perf.filesystem] write_gbytes_per_s, node_write_gbytes_per_s and "
                       "host_copy_gbytes_per_s must be above 0")
    result = FileSystem(fs.get("name", str), rates["write_gbytes_per_s"],
                        rates["node_write_gbytes_per_s"], rates["host_copy_gbytes_per_s"])
    fs.done()
    return result
