"""Gradient allreduce through the node's shared memory (MPI-3 shared windows), for CPU
gradients.

An MPI allreduce inside a node copies every byte through the library's message cells;
here the gradient buckets live in one ``MPI_Win_allocate_shared`` window per node, so
rank i sums its peers' slice i in place, allreduces it across nodes (hierarchical), and
pushes the sum into every peer's bucket (pushing writes lines the writer has just read).
Phases are announced through epoch flags, with ``MPI_Win_sync`` between data and flag;
each slice is summed by one rank, so every rank ends with the same bits.
Phases, the measurements against MPICH's ``Allreduce``, and when: docs/design/shm-allreduce.md.
"""

from __future__ import annotations

import collections
import os

import numpy as np
import torch

from hpctrain.comm.mpi import MPI
from hpctrain.comm.resources import MPIResources
from hpctrain.errors import ConfigError

ARRIVED, DONE = 0, 1
_ALIGN = 64  # bytes: slices and buckets start on their own cache line
_FLAG_STRIDE = _ALIGN // 8  # int64 flags per bucket row (one cache line)


def _align(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def slice_bounds(numel: int, parts: int) -> list[int]:
    """Split ``numel`` fp32 elements into ``parts`` slices on cache-line boundaries (the
    last slices may be empty when the bucket is tiny)."""
    per = _ALIGN // 4
    step = -(-numel // parts)
    step = -(-step // per) * per
    return [min(numel, i * step) for i in range(parts + 1)]


def shared_bytes_needed(numels: list[int]) -> int:
    """Bytes of one rank's segment: a flag row per bucket, then the buckets."""
    return len(numels) * _ALIGN + sum(_align(4 * n) for n in numels)


def free_shared_memory_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes where MPI maps shared windows on Linux; None when it cannot tell."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class SharedMemoryAllreduce:
    """Holds every local rank's gradient buckets in one shared window and sums them.

    Collective over ``comm``: every rank passes the same bucket sizes. ``flat(i)`` is
    this rank's bucket i (give it to the gradients); ``start(i)`` returns a request whose
    ``Test()`` advances the reduction and is True when the bucket holds the sum and no
    peer reads it any more. ``node_comm`` (default: the shared-memory split of ``comm``)
    can be narrower than a real node, which is how tests play several nodes on one; the
    arena works on its own duplicate of it.
    """

    def __init__(self, comm: MPI.Comm, numels: list[int], *, node_comm: MPI.Comm | None = None):
        if not numels:
            raise ValueError("no buckets to reduce")
        # Freed in reverse order by close(): the window, then the communicators.
        self.resources = MPIResources()
        node = self.resources.add(node_comm.Dup() if node_comm is not None
                                  else comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank))
        sizes = comm.allgather(node.size)
        if len(set(sizes)) > 1:  # the same answer on every rank: all raise together
            self.resources.close()
            raise ConfigError("the shared-memory allreduce needs the same number of ranks "
                              f"on every node (found {sorted(set(sizes))}); use "
                              "--comm.transport=mpi")
        self.node = node
        self.local, self.local_size = node.rank, node.size
        n_nodes = comm.size // self.local_size
        # Ranks holding the same slice on every node reduce it across nodes. Collectives
        # on it must start in the same order everywhere: bucket launch order, kept by
        # ``cross_queue`` whatever order the requests are tested in.
        self.cross = (self.resources.add(comm.Split(self.local, comm.rank)) if n_nodes > 1
                      else None)
        self.cross_queue: collections.deque = collections.deque()
        self.bounds = [slice_bounds(n, self.local_size) for n in numels]
        nbytes = shared_bytes_needed(numels)
        self.win = MPI.Win.Allocate_shared(nbytes, 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # passive epoch for Sync (no locking done)
        self.resources.add(self.win, self._free_window)
        self.flags: list[np.ndarray] = []
        self.flats: list[list[torch.Tensor]] = []  # [local rank][bucket]
        for r in range(self.local_size):
            mem, _ = self.win.Shared_query(r)
            seg = np.frombuffer(mem, dtype=np.uint8, count=nbytes)
            self.flags.append(seg[:len(numels) * _ALIGN].view(np.int64)
                              .reshape(len(numels), _FLAG_STRIDE))
            offset, flats = len(numels) * _ALIGN, []
            for n in numels:
                flats.append(torch.from_numpy(seg[offset:offset + 4 * n].view(np.float32)))
                offset += _align(4 * n)
            self.flats.append(flats)
        self.flags[self.local][:] = 0
        self.epochs = [0] * len(numels)
        self.node.Barrier()  # every row zeroed before anyone polls it

    def flat(self, bucket: int) -> torch.Tensor:
        """This rank's bucket ``bucket``: a flat fp32 tensor in the shared window."""
        return self.flats[self.local][bucket]

    def start(self, bucket: int) -> "ShmReduction":
        self.epochs[bucket] += 1
        request = ShmReduction(self, bucket, self.epochs[bucket])
        if self.cross is not None:
            self.cross_queue.append(request)
        return request

    # -------------------------------------------------------------- the phases
    def raise_flag(self, bucket: int, phase: int, epoch: int) -> None:
        self.win.Sync()  # our data writes are visible before the flag is
        self.flags[self.local][bucket, phase] = epoch

    def all_reached(self, bucket: int, phase: int, epoch: int) -> bool:
        for row in self.flags:
            if row[bucket, phase] < epoch:
                return False
        self.win.Sync()  # the peers' data is read only after their flags were seen
        return True

    def reduce_own_slice(self, bucket: int) -> torch.Tensor:
        lo, hi = self.bounds[bucket][self.local], self.bounds[bucket][self.local + 1]
        mine = self.flats[self.local][bucket][lo:hi]
        for r in range(self.local_size):
            if r != self.local:
                mine.add_(self.flats[r][bucket][lo:hi])
        return mine

    def push_own_slice(self, bucket: int) -> None:
        """Write this rank's summed slice into every peer's copy of the bucket."""
        lo, hi = self.bounds[bucket][self.local], self.bounds[bucket][self.local + 1]
        if hi > lo:
            mine = self.flats[self.local][bucket][lo:hi]
            for r in range(self.local_size):
                if r != self.local:
                    self.flats[r][bucket][lo:hi].copy_(mine)

    def _free_window(self) -> None:
        self.flats, self.flags = [], []  # drop the views into the window first
        self.win.Unlock_all()
        self.win.Free()

    def close(self) -> None:
        """Free the window and the communicators. Collective over the node; idempotent."""
        self.resources.close()


class ShmReduction:
    """One bucket's reduction in flight; ``Test()`` does what the peers' flags allow
    without waiting (so the scheduler can poll it from gradient hooks and from
    ``wait_all``) and is True once every rank has written its sums everywhere."""

    def __init__(self, arena: SharedMemoryAllreduce, bucket: int, epoch: int):
        self.arena, self.bucket, self.epoch = arena, bucket, epoch
        self.cross_req: MPI.Request | None = None
        self.summed = self.pushed = False
        arena.raise_flag(bucket, ARRIVED, epoch)

    def Test(self) -> bool:  # noqa: N802 (the MPI.Request spelling, for wait_all)
        a, b, e = self.arena, self.bucket, self.epoch
        if not self.summed:
            if a.cross is not None and a.cross_queue[0] is not self:
                return False  # an earlier bucket's inter-node collective starts first
            if not a.all_reached(b, ARRIVED, e):
                return False
            mine = a.reduce_own_slice(b)
            if a.cross is not None:  # then sum our slice over the nodes
                self.cross_req = a.cross.Iallreduce(MPI.IN_PLACE, mine.numpy(), op=MPI.SUM)
                a.cross_queue.popleft()
            self.summed = True
        if self.cross_req is not None:
            if not self.cross_req.Test():
                return False
            self.cross_req = None
        if not self.pushed:
            a.push_own_slice(b)
            a.raise_flag(b, DONE, e)
            self.pushed = True
        return a.all_reached(b, DONE, e)



def use_shared_memory(setting: str, comm: MPI.Comm, device: str, numels: list[int],
                      ranks_on_node: int | None = None, collectives: str = "mpi") -> bool:
    """Decide, the same on every rank, whether gradients are summed through the node's
    shared memory. Collective over ``comm``.

    ``device``: the gradients' device kind (``cpu``; device memory of ``cuda``, ``xpu`` or
    ``fake`` is never summed here). ``setting`` is ``mpi`` (never), ``shm`` (always; an
    error when impossible) or ``auto``: for CPU gradients when nodes hold several ranks each, the same number on
    every node, and ``/dev/shm`` has room for the node's buckets. ``ranks_on_node``: all
    the job's ranks on this node (each allocates a segment, whatever group it reduces
    in: pipeline stages on one node each have a window); default, ``comm``'s.
    ``collectives``: the world's (``CommConfig.collectives``); with ``xccl`` the device
    library sums."""
    if setting == "mpi" or comm.size == 1:
        return False
    if collectives != "mpi":
        if setting == "shm":
            raise ConfigError("--comm.transport=shm sums through MPI's shared memory; "
                              "with xccl the device library sums: use --comm.transport=xccl "
                              "or auto")
        return False
    if str(device).split(":")[0] != "cpu":
        if setting == "shm":
            raise ConfigError("--comm.transport=shm sums CPU gradients; device gradients "
                              "go through MPI (GPU-aware or staged): use "
                              "--comm.transport=auto or mpi")
        return False
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_size = node.size
    node.Free()
    free = free_shared_memory_bytes()
    segments = max(local_size, ranks_on_node or 0)
    room = free is None or free > 1.25 * segments * shared_bytes_needed(numels)
    every = comm.allgather((local_size, room))  # one collective for both answers
    sizes = {size for size, _ in every}
    even = len(sizes) == 1 and local_size > 1
    fits = all(ok for _, ok in every)
    if setting == "shm" and not (even and fits):
        why = ("nodes hold different numbers of ranks" if len(sizes) > 1 else
               "every node holds a single rank" if not even else
               "/dev/shm has too little room for the node's gradient buckets")
        raise ConfigError(f"--comm.transport=shm is impossible here: {why}; use "
                         "--comm.transport=auto or mpi")
    return even and fits
