"""The ranks of a job: who am I, where am I, which device is mine.

``World`` is built once at start-up and passed explicitly to whatever needs it; nothing
reads ranks or communicators from a module global. The communicator is a parameter, so
the same code runs on ``COMM_WORLD`` or on ``COMM_SELF`` (the single-process reference).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import GPUAwareness, detect_gpu_aware
from hpctrain.comm.mpi import MPI
from hpctrain.comm.placement import choose_kind, make_accelerator, visible_devices
from hpctrain.comm.resources import MPIResources
from hpctrain.comm.transport import Transport, make_transport, resolve_collectives
from hpctrain.comm.watchdog import pace_for_node
from hpctrain.errors import UserError

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class World:
    comm: MPI.Comm
    """The communicator every rank of this job belongs to."""
    rank: int
    size: int
    local_comm: MPI.Comm
    """Ranks on the same node (a shared-memory split of ``comm``)."""
    local_rank: int
    local_size: int
    node: int
    """Index of this node among the job's nodes, 0-based, ordered by lowest rank."""
    n_nodes: int
    device: str
    """The torch device this rank's tensors live on: ``cuda:1``, ``xpu:0``, ``cpu`` (the
    fake accelerator's tensors live on ``cpu`` too)."""
    accel: Accelerator = field(compare=False)
    """The device layer of this rank (``comm/device.py``): events, staging buffers,
    counters; its ``kind`` is cpu, cuda, xpu or fake."""
    gpu_aware: GPUAwareness
    """Whether MPI takes this rank's device memory directly (``comm/gpu_aware.py``)."""
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any blocking MPI wait may take before the job is aborted."""
    device_setting: str = "auto"
    """What ``--train.device`` asked for (``device`` is what it resolved to)."""
    ranks_per_device: int = 1
    """Ranks of this node computing on this rank's device (several: they share it)."""
    devices: int = 1
    """Distinct devices the job computes on (ranks sharing a device count once; on the
    host every rank counts as one)."""
    collectives: str = "mpi"
    """How bulk data (gradient buckets, shards, parameters) moves: ``mpi``, or ``xccl``,
    the device's collective library (``comm/transport.py``)."""
    transport: Transport = field(init=False, compare=False, repr=False)
    """That transport over ``comm`` (made anew for a view with another ``comm``)."""

    def __post_init__(self):
        object.__setattr__(self, "transport", make_transport(
            self.collectives, self.comm, self.accel, self.gpu_aware))
    resources: MPIResources = field(default_factory=MPIResources, compare=False, repr=False)
    """``local_comm``, freed by ``close()`` (views made with ``dataclasses.replace`` share
    it: only the world that ``create`` returned is closed)."""

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def create(cls, comm: MPI.Comm | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
               device: str = "auto", gpu_aware: str = "auto", collectives: str = "mpi",
               system: str | None = None) -> "World":
        """Build the world on ``comm`` (default ``COMM_WORLD``). Collective over ``comm``.

        ``device``: ``--train.device`` (auto, cpu, cuda, xpu, fake); ``gpu_aware``:
        ``--comm.gpu_aware``; ``collectives``: ``CommConfig.collectives`` (mpi, xccl,
        auto; from ``--comm.transport``); ``system``: the system profile the job runs
        under (``HPCTRAIN_SYSTEM``), whose GPUs ``auto`` must find."""
        comm = MPI.COMM_WORLD if comm is None else comm
        rank, size = comm.Get_rank(), comm.Get_size()
        resources = MPIResources()
        local_comm = resources.add(_node_comm(comm, rank))
        local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
        pace_for_node(node_oversubscribed(local_size, threads_per_rank(local_size)))
        # Node index: number the lowest rank of each node, then share it within the node.
        is_leader = int(local_rank == 0)
        leaders = comm.allgather(is_leader)
        node = sum(leaders[:rank]) if is_leader else 0
        node = local_comm.bcast(node, root=0)
        n_nodes = sum(leaders)
        kind = _agree_on_kind(comm, device, system)
        masks = local_comm.allgather(visible_devices(kind).mask)
        accel = make_accelerator(kind, local_rank, masks)
        check_thread_level(accel, MPI.Query_thread())
        sharing, devices = count_devices(
            comm.allgather((node, accel.identity() or f"rank {rank}")), rank)
        collectives = resolve_collectives(collectives, comm, accel, timeout)
        return cls(comm=comm, rank=rank, size=size, local_comm=local_comm,
                   local_rank=local_rank, local_size=local_size, node=node,
                   n_nodes=n_nodes, device=str(accel.torch_device), accel=accel,
                   gpu_aware=detect_gpu_aware(gpu_aware, accel.vendor), timeout=timeout,
                   resources=resources, device_setting=device,
                   ranks_per_device=sharing, devices=devices, collectives=collectives)

    def close(self) -> None:
        """Free the node communicator (collective; idempotent)."""
        self.resources.close()
        self.accel.close()

    def describe(self) -> str:
        text = (f"{self.size} rank(s) on {self.n_nodes} node(s), device "
                f"{self.accel.describe()}")
        if self.collectives != "mpi":
            text += f", collectives {self.transport.name}"
        if self.accel.is_accelerator:
            text += (f", GPU-aware MPI: {self.gpu_aware}, MPI thread level "
                     f"{THREAD_LEVELS.get(MPI.Query_thread(), '?')}")
        return text


RANKS_PER_NODE_ENV = "HPCTRAIN_TEST_RANKS_PER_NODE"
"""Test-only: simulate nodes of this many consecutive ranks within the real ones (tests
of per-node behaviour, e.g. ``--train.ckpt_files=node``, on one machine)."""


def _node_comm(comm: MPI.Comm, rank: int) -> MPI.Comm:
    """The ranks of this rank's node: a shared-memory split of ``comm``, cut into
    simulated nodes where ``HPCTRAIN_TEST_RANKS_PER_NODE`` asks (collective)."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    text = os.environ.get(RANKS_PER_NODE_ENV, "").strip()
    if not text:
        return shared
    if not text.isdigit() or int(text) < 1:
        shared.Free()
        raise UserError(f"{RANKS_PER_NODE_ENV}={text!r} must be a whole number >= 1 (the "
                        "ranks of each simulated node, for tests); unset it to use the "
                        "real nodes")
    node = shared.Split(color=rank // int(text), key=rank)
    shared.Free()
    return node


def count_devices(identities: list, rank: int) -> tuple[int, int]:
    """(ranks on ``rank``'s device, distinct devices of the job) from every rank's
    ``(node, device identity)``."""
    return identities.count(identities[rank]), len(set(identities))


class _ThreadLevels(Mapping):
    """MPI thread level -> its name (``single`` ... ``multiple``); MPI's constants are
    read when first asked for, so importing this module starts no MPI."""

    def _names(self) -> dict:
        return {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}

    def __getitem__(self, level: int) -> str:
        return self._names()[level]

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


THREAD_LEVELS = _ThreadLevels()


THREAD_LEVEL_HINT = ("unset MPI4PY_RC_THREAD_LEVEL (mpi4py asks for MULTIPLE by default); "
                     "on Cray MPICH (Polaris, Perlmutter, Frontier) export "
                     "MPICH_MAX_THREAD_SAFETY=multiple, which caps the level Cray MPICH "
                     "grants (the systems' profiles set it); or use an MPI built with "
                     "thread support")
"""How to get a higher MPI thread level, for the messages that need one."""


def check_thread_level(accel: Accelerator, provided: int) -> None:
    """Refuse a thread level the device cannot train with. On a GPU autograd runs the
    gradient hooks, which start reductions, on a device thread of its own while the main
    thread waits in ``backward()``: MPI is called from two threads, one at a time, which
    needs ``MPI_THREAD_SERIALIZED``. (Reading data with MPI-IO in the background needs
    ``MPI_THREAD_MULTIPLE``; without it the reader runs in the main thread,
    ``data/loader.py``, and the start-up line says so.)"""
    if accel.hooks_off_main_thread and provided < MPI.THREAD_SERIALIZED:
        raise UserError(
            f"the MPI library provides thread level MPI_THREAD_"
            f"{THREAD_LEVELS.get(provided, provided).upper()}, but on {accel.kind} gradient "
            "hooks call MPI from autograd's device thread, which needs "
            f"MPI_THREAD_SERIALIZED or MULTIPLE; {THREAD_LEVEL_HINT}")


def _agree_on_kind(comm: MPI.Comm, setting: str, system: str | None) -> str:
    """Every rank's device kind, the same everywhere, or one error on every rank."""
    kind = error = None
    try:
        kind = choose_kind(setting, system=system)
    except UserError as e:
        error = str(e)
    answers = comm.allgather((kind, error))
    errors = [(r, e) for r, (_, e) in enumerate(answers) if e]
    if errors:
        r, e = errors[0]
        everywhere = len(errors) == len(answers) and len({x for _, x in errors}) == 1
        raise UserError(e if everywhere else f"rank {r}: {e}")
    kinds = sorted({k for k, _ in answers})
    if len(kinds) > 1:
        where = {k: next(r for r, (x, _) in enumerate(answers) if x == k) for k in kinds}
        raise UserError(f"--train.device={setting} found different devices on different "
                        f"ranks ({', '.join(f'{k} on rank {r}' for k, r in where.items())}); "
                        "give every node the same devices, or name one with --train.device")
    return kinds[0]


@dataclass(frozen=True)
class Threads:
    """The CPU threads a rank computes with, and why that many (for the start-up line)."""
    count: int
    why: str


def choose_threads(local_size: int, *, env: dict | None = None, bound: int | None = None,
                   node_cpus: int | None = None) -> Threads:
    """CPU threads a rank should use so the ranks on a node do not oversubscribe it.

    The CPUs this process may run on (its affinity mask, which ``--cpu-bind`` and
    ``srun -c`` narrow) are the most it can use: ``OMP_NUM_THREADS`` counts when set, but
    never beyond them (a rank bound to 2 CPUs with 8 threads time-slices them, several
    times slower). Otherwise the mask, when the launcher narrowed it, or the node's CPUs
    shared among its ranks. ``env``, ``bound`` and ``node_cpus`` default to this
    process's."""
    env = os.environ if env is None else env
    bound = bound or _bound_cpus()
    node_cpus = node_cpus or os.cpu_count() or 1
    asked = env.get("OMP_NUM_THREADS", "")
    if asked.isdigit() and int(asked) > 0:
        if int(asked) > bound:
            return Threads(bound, f"bound to {bound} CPU(s), fewer than "
                                  f"OMP_NUM_THREADS={asked}")
        return Threads(int(asked), f"OMP_NUM_THREADS={asked}")
    if bound < node_cpus:  # the launcher bound us to our own CPUs already
        return Threads(bound, f"the {bound} CPU(s) this rank is bound to")
    share = max(1, node_cpus // max(1, local_size))
    return Threads(share, f"{node_cpus} CPU(s) shared by {local_size} rank(s) of the node")


def _bound_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def threads_per_rank(local_size: int) -> int:
    """``choose_threads(local_size).count``."""
    return choose_threads(local_size).count


def node_oversubscribed(local_size: int, threads: int) -> bool:
    """True when this node's ranks run more threads than it has cores."""
    return local_size * max(1, threads) > (os.cpu_count() or 1)
