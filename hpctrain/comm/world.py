"""The ranks of a job: who am I, where am I, which device is mine.

``World`` is built once at start-up and passed explicitly to whatever needs it; nothing
reads ranks or communicators from a module global. The communicator is a parameter, so
the same code runs on ``COMM_WORLD`` or on ``COMM_SELF`` (the single-process reference).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mpi4py import MPI

from hpctrain.comm.buffers import CudaAwareness, detect_cuda_aware
from hpctrain.comm.resources import MPIResources

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
    """``cuda:<local_rank % n_gpus>`` when CUDA exists, else ``cpu``."""
    cuda_aware: CudaAwareness
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any blocking MPI wait may take before the job is aborted."""
    resources: MPIResources = field(default_factory=MPIResources, compare=False, repr=False)
    """``local_comm``, freed by ``close()`` (views made with ``dataclasses.replace`` share
    it: only the world that ``create`` returned is closed)."""

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def create(cls, comm: MPI.Comm | None = None, *, timeout: float = DEFAULT_TIMEOUT_S,
               cuda_aware: str = "auto", use_cuda: bool = True) -> "World":
        """Build the world on ``comm`` (default ``COMM_WORLD``). Collective over ``comm``."""
        comm = MPI.COMM_WORLD if comm is None else comm
        rank, size = comm.Get_rank(), comm.Get_size()
        resources = MPIResources()
        local_comm = resources.add(comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank))
        local_rank, local_size = local_comm.Get_rank(), local_comm.Get_size()
        # Node index: number the lowest rank of each node, then share it within the node.
        is_leader = int(local_rank == 0)
        leaders = comm.allgather(is_leader)
        node = sum(leaders[:rank]) if is_leader else 0
        node = local_comm.bcast(node, root=0)
        n_nodes = sum(leaders)
        device = _pick_device(local_rank) if use_cuda else "cpu"
        return cls(comm=comm, rank=rank, size=size, local_comm=local_comm,
                   local_rank=local_rank, local_size=local_size, node=node,
                   n_nodes=n_nodes, device=device,
                   cuda_aware=detect_cuda_aware(cuda_aware), timeout=timeout,
                   resources=resources)

    def close(self) -> None:
        """Free the node communicator (collective; idempotent)."""
        self.resources.close()

    def describe(self) -> str:
        return (f"{self.size} rank(s) on {self.n_nodes} node(s), device {self.device}, "
                f"CUDA-aware MPI: {self.cuda_aware}")


def _pick_device(local_rank: int) -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def threads_per_rank(local_size: int) -> int:
    """CPU threads a rank should use so the ranks on a node do not oversubscribe it.

    Respects ``OMP_NUM_THREADS`` when set. Otherwise shares the cores this process may
    run on (its affinity mask, which ``--cpu-bind`` narrows on HPC launchers) among the
    ranks of the node, unless the mask is already narrower than a node's share.
    """
    env = os.environ.get("OMP_NUM_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    node_cores = os.cpu_count() or 1
    if cores < node_cores:  # the launcher bound us to our own cores already
        return max(1, cores)
    return max(1, node_cores // max(1, local_size))


def node_oversubscribed(local_size: int, threads: int) -> bool:
    """True when this node's ranks run more threads than it has cores."""
    return local_size * max(1, threads) > (os.cpu_count() or 1)
