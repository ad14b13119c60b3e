"""How a bucket's bytes move between ranks: one interface, four implementations.

The gradient engines and the pipeline executor decide *when* data moves (bucket order,
the schedule); a ``Transport`` decides *how*. They hand it buffers (``prepare``,
``ready``, the operation, ``complete``) and get back requests that answer ``Test()``
without blocking. ``MPITransport`` and ``PersistentMPITransport`` are here;
``ShmTransport`` (``shm_transport.py``) and ``XcclTransport`` (``xccl_transport.py``)
beside. MPI stays in charge of everything else: start-up, small metadata, the stop
agreement, deadlines, aborts and MPI-IO.
The interface, each implementation and why: docs/design/collectives.md.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import GPUAwareness
from hpctrain.comm.mpi import MPI
from hpctrain.comm.resources import MPIResources


@runtime_checkable
class Request(Protocol):
    def Test(self) -> bool:
        """Whether the operation is done (never blocks)."""


@runtime_checkable
class CommBuffer(Protocol):
    staging_nbytes: int
    """Bytes of a host copy kept for the transport (0: it reads the memory itself)."""

    def prepare(self, send: bool = True) -> None:
        """The device work that writes the buffer is queued: mark it (an event) and
        queue what the transport needs first (a staging copy). ``send=False``: the
        operation only writes the buffer."""

    def ready(self) -> bool:
        """Whether the operation may start now (the marked work is done); never blocks."""

    def complete(self) -> None:
        """After the operation that wrote the buffer: its result is in the tensor (a
        staged result is copied back; queued on the device, nothing waits)."""


@runtime_checkable
class Transport(Protocol):
    name: str
    """``mpi``, or the device library (``nccl``, ``xccl``, ``gloo``, ...)."""
    size: int
    rank: int

    def buffer(self, tensor, *, reduction: bool = False, raw: bool = False) -> CommBuffer:
        """The transport's view of ``tensor`` (kept: build once per tensor that stays).
        ``reduction``: it takes part in reductions; ``raw``: its storage is freed and
        re-allocated between uses (ZeRO-3's gathered parameters)."""

    def allreduce(self, buf: CommBuffer) -> Request:
        """Sum over the ranks, in place."""

    def reduce_scatter(self, buf: CommBuffer) -> Request:
        """Sum over the ranks; this rank's 1/size slice of the sum lands at the start
        of ``buf`` (MPI_Reduce_scatter_block with MPI_IN_PLACE)."""

    def allgather(self, buf: CommBuffer, shard: CommBuffer | None = None) -> Request:
        """Every rank's slice into ``buf``: from ``shard`` or, without one, in place
        (each rank's slice already at ``rank * len(buf) / size``)."""

    def allgather_each(self, bufs: list[CommBuffer]) -> list[Request]:
        """``allgather`` in place of each buffer, issued in order (one wait for the
        device covers them all)."""

    def broadcast(self, buf: CommBuffer, root: int) -> Request: ...

    def broadcast_each(self, bufs: list[CommBuffer], root: int) -> list[Request]:
        """``broadcast`` of each buffer from ``root``, issued in order."""

    def send(self, buf: CommBuffer, peer: int, tag: int) -> Request: ...

    def recv(self, buf: CommBuffer, peer: int, tag: int) -> Request: ...

    def sibling(self) -> "Transport":
        """A second channel over the same ranks, whose operations never interleave with
        this one's (ZeRO-3's parameter gathers beside the gradient reductions)."""

    def close(self) -> None:
        """Release what this transport made (collective; idempotent)."""


class MPITransport:
    """MPI on ``comm``; device buffers direct or staged per ``aware``."""

    name = "mpi"

    def __init__(self, comm: MPI.Comm, accel: Accelerator, aware: GPUAwareness, *,
                 owns_comm: bool = False):
        self.comm, self.accel, self.aware = comm, accel, aware
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._owns = owns_comm

    def buffer(self, tensor, *, reduction: bool = False, raw: bool = False) -> MPIBuffer:
        """``raw``: host storage that is freed and re-allocated (``MPIBuffer``)."""
        return MPIBuffer(tensor, self.accel, self.aware, reduction=reduction, raw=raw)

    def allreduce(self, buf: MPIBuffer) -> MPI.Request:
        return self.comm.Iallreduce(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)

    def reduce_scatter(self, buf: MPIBuffer) -> MPI.Request:
        return self.comm.Ireduce_scatter_block(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)

    def allgather(self, buf: MPIBuffer, shard: MPIBuffer | None = None) -> MPI.Request:
        if shard is None:
            return self.comm.Iallgather(MPI.IN_PLACE, buf.to_mpi())
        if not buf.prepared:
            buf.prepare(send=False)  # only written: nothing to stage
        send, recv = to_mpi_all([shard, buf])
        return self.comm.Iallgather(send, recv)

    def allgather_each(self, bufs: list[MPIBuffer]) -> list[MPI.Request]:
        return [self.comm.Iallgather(MPI.IN_PLACE, obj) for obj in to_mpi_all(bufs)]

    def broadcast(self, buf: MPIBuffer, root: int) -> MPI.Request:
        return self.comm.Ibcast(buf.to_mpi(send=self.rank == root), root=root)

    def broadcast_each(self, bufs: list[MPIBuffer], root: int) -> list[MPI.Request]:
        return [self.comm.Ibcast(obj, root=root)
                for obj in to_mpi_all(bufs, send=self.rank == root)]

    def send(self, buf: MPIBuffer, peer: int, tag: int) -> MPI.Request:
        return self.comm.Isend(buf.to_mpi(), dest=peer, tag=tag)

    def recv(self, buf: MPIBuffer, peer: int, tag: int) -> MPI.Request:
        return self.comm.Irecv(buf.to_mpi(send=False), source=peer, tag=tag)

    def sibling(self) -> "MPITransport":
        """On a duplicate of the communicator (freed by the sibling's ``close``)."""
        return MPITransport(self.comm.Dup(), self.accel, self.aware, owns_comm=True)

    def close(self) -> None:
        if self._owns and self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self._owns = False



class PersistentMPITransport(MPITransport):
    """MPI whose allreduce of a reduction buffer is a persistent collective (MPI-4
    ``Allreduce_init`` once, when the buffer is made; ``Start`` each time: the schedule is
    built once). The buffer never moves, so the request stays valid; buffers must be made
    in the same order on every rank (the init is collective). Nothing else changes."""

    def __init__(self, comm: MPI.Comm, accel: Accelerator, aware: GPUAwareness):
        super().__init__(comm, accel, aware)
        self.resources = MPIResources()
        self._requests: dict[int, tuple[MPIBuffer, MPI.Prequest]] = {}

    def buffer(self, tensor, *, reduction: bool = False, raw: bool = False) -> MPIBuffer:
        buf = super().buffer(tensor, reduction=reduction, raw=raw)
        if reduction:
            req = self.comm.Allreduce_init(MPI.IN_PLACE, buf.to_mpi(), op=MPI.SUM)
            self._requests[id(buf)] = (buf, self.resources.add(req))
        return buf

    def allreduce(self, buf: MPIBuffer) -> MPI.Request:
        kept = self._requests.get(id(buf))
        if kept is None:
            return super().allreduce(buf)
        buf.to_mpi()  # waits for the event behind the buffer's last write
        kept[1].Start()
        return kept[1]

    def close(self) -> None:
        """Free the persistent requests (collective; idempotent)."""
        self._requests.clear()
        self.resources.close()
        super().close()


COLLECTIVES = ("auto", "mpi", "xccl")


def resolve_collectives(setting: str, comm: MPI.Comm, accel: Accelerator,
                        timeout: float) -> str:
    """The world's bulk transport (``CommConfig.collectives``): ``mpi``, ``xccl``, or
    ``auto`` (``xccl`` on a GPU whose library this torch build has, ``mpi`` on the
    host). For ``xccl`` over several ranks the device library is started
    (``device_collectives.start``). Collective."""
    if setting not in COLLECTIVES:
        raise ValueError(f"collectives={setting!r} is not one of {COLLECTIVES}")
    if setting == "mpi" or (setting == "auto" and not accel.is_accelerator):
        return "mpi"
    from hpctrain.comm import device_collectives

    if setting == "auto" and (accel.kind == "fake"
                              or device_collectives.backend_for(accel.kind) is None):
        return "mpi"
    if comm.Get_size() > 1:
        device_collectives.start(comm, accel, timeout)
        device_collectives.make_groups([list(device_collectives.world_ranks(comm))], "gather")
    return "xccl"


def make_transport(collectives: str, comm: MPI.Comm, accel: Accelerator,
                   aware: GPUAwareness) -> Transport:
    """The transport of ``collectives`` over ``comm``; one rank moves nothing between
    ranks, so it keeps MPI's."""
    if collectives == "xccl" and comm.Get_size() > 1:
        from hpctrain.comm.xccl_transport import XcclTransport

        return XcclTransport(comm, accel)
    return MPITransport(comm, accel, aware)
