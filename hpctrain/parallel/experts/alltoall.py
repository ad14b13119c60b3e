"""The all-to-all of expert parallelism as an autograd function, and its MPI transport.

``all_to_all`` sends ``send_rows[p]`` consecutive rows of ``x`` to peer ``p`` and
returns the rows every peer sent, in peer order; its backward is the same exchange of
the gradients with the split sizes swapped (each row's gradient goes back to the rank
the row came from). The transport is a parameter: ``MPIAllToAll`` here (``Ialltoallv``,
device memory direct when MPI is GPU-aware, else staged by ``comm/buffers.py``),
``DeviceAllToAll`` (``device_alltoall.py``) on the device library. Both exchange the
counts, a few integers, over MPI. Every wait has the run's deadline and names the step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hpctrain.comm.buffers import MPIBuffer, to_mpi_all
from hpctrain.comm.device import Accelerator
from hpctrain.comm.gpu_aware import HOST_MEMORY, GPUAwareness
from hpctrain.comm.watchdog import wait_all
from hpctrain.comm.world import DEFAULT_TIMEOUT_S


class AllToAll:
    """An expert-parallel group's communicator and how it moves rows (``rows``)."""

    def __init__(self, comm, *, timeout: float = DEFAULT_TIMEOUT_S,
                 accel: Accelerator | None = None, aware: GPUAwareness = HOST_MEMORY):
        """``comm``: the group's mpi4py communicator (rank ``r`` holds the ``r``-th slice
        of the experts); ``timeout``: every wait's deadline (``--comm.timeout``);
        ``accel``/``aware``: the rank's device and whether MPI reads its memory."""
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.timeout, self.accel, self.aware = timeout, accel, aware

    def counts(self, table: torch.Tensor) -> torch.Tensor:
        """Row ``p`` of the (ep, L) int64 ``table`` to peer ``p``; returns the (ep, L)
        table of what each peer sends this rank (one ``Ialltoall`` of host integers)."""
        send = np.ascontiguousarray(table.detach().cpu().numpy(), dtype=np.int64)
        recv = np.empty_like(send)
        wait_all([self.comm.Ialltoall(send, recv)], timeout=self.timeout,
                 what="expert parallelism: exchanging the token counts", together=True)
        return torch.from_numpy(recv)

    def rows(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int],
             what: str) -> torch.Tensor:
        """``send_rows[p]`` rows of ``x`` to peer ``p``; the ``recv_rows[p]`` rows from
        each peer, in peer order (a new tensor on ``x``'s device)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the transport made (nothing here)."""

    def _what(self, what: str) -> str:
        return f"expert parallelism: {what} all-to-all over {self.size} ranks"


def _spec(rows: list[int]) -> tuple[list[int], list[int]]:
    """Counts and displacements (in rows) of consecutive blocks of ``rows`` rows."""
    return rows, [sum(rows[:p]) for p in range(len(rows))]


def received_like(x: torch.Tensor, recv_rows: list[int]) -> torch.Tensor:
    return torch.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)


class MPIAllToAll(AllToAll):
    """Rows by ``Ialltoallv`` through ``MPIBuffer`` (handed over directly or staged,
    after the event of its last write), counted in an MPI type of one row's bytes: any
    dtype travels as its bit pattern (bf16 too), and counts stay far below 2^31."""

    def __init__(self, comm, **kwargs):
        super().__init__(comm, **kwargs)
        self._row_types: dict[int, object] = {}

    def _row_type(self, row_bytes: int):
        from mpi4py import MPI

        if row_bytes not in self._row_types:
            self._row_types[row_bytes] = MPI.BYTE.Create_contiguous(row_bytes).Commit()
        return self._row_types[row_bytes]

    def rows(self, x, send_rows, recv_rows, what):
        x = x.detach().contiguous()
        received = received_like(x, recv_rows)
        row = self._row_type(math.prod(x.shape[1:]) * x.element_size())
        send = MPIBuffer(x, self.accel, self.aware)
        recv = MPIBuffer(received, self.accel, self.aware)
        recv.prepare(send=False)  # only written: nothing to stage
        send_obj, recv_obj = to_mpi_all([send, recv])
        request = self.comm.Ialltoallv([send_obj, _spec(send_rows), row],
                                       [recv_obj, _spec(recv_rows), row])
        wait_all([request], timeout=self.timeout, what=self._what(what), together=True)
        recv.complete()
        return received

    def close(self) -> None:
        """Free the row types (the transport is not used after)."""
        for row in self._row_types.values():
            row.Free()
        self._row_types.clear()


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, transport: AllToAll, send_rows, recv_rows, what: str):
        ctx.transport, ctx.splits, ctx.what = transport, (send_rows, recv_rows), what
        return transport.rows(x, send_rows, recv_rows, what)

    @staticmethod
    def backward(ctx, grad):
        send_rows, recv_rows = ctx.splits
        back = ctx.transport.rows(grad.contiguous(), recv_rows, send_rows,
                                  f"{ctx.what} (backward)")
        return back, None, None, None, None


def all_to_all(x: torch.Tensor, transport: AllToAll, send_rows: list[int],
               recv_rows: list[int], what: str) -> torch.Tensor:
    """``transport.rows`` with autograd: the gradient takes the reverse exchange."""
    return _AllToAllRows.apply(x, transport, send_rows, recv_rows, what)
