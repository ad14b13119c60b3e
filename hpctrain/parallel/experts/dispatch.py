"""Dispatch and combine: the model layer's routed token copies to their experts and the
experts' outputs back, as one call (``TokenDispatch``).

``LocalDispatch`` (ep = 1) runs the experts on the copies as they are.
``ExpertParallelDispatch`` over ``ep`` ranks, rank ``r`` holding global experts
``[r L, (r + 1) L)``: (1) the counts each peer will receive per local expert, exchanged
first; (2) the rows to their experts' ranks; (3) regrouped by local expert, the experts
run, and put back in arrival order; (4) the rows back to their sources, in the order of
``routed``. Gradients take the same two all-to-alls in reverse (``alltoall.py``).
The index arithmetic: ``permute.py``.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from hpctrain.parallel.experts import permute
from hpctrain.parallel.experts.alltoall import AllToAll, MPIAllToAll, all_to_all

Experts = Callable[[torch.Tensor, list], torch.Tensor]
"""``experts(tokens, local_counts)``: this rank's local experts on ``tokens`` (rows
grouped by local expert, ``local_counts[j]`` of them for expert ``j``); the same number
of rows in the same order. Autograd flows through it (it holds the expert weights)."""


class TokenDispatch(Protocol):
    def __call__(self, routed: torch.Tensor, counts: torch.Tensor,
                 experts: Experts) -> torch.Tensor:
        """``routed`` (M, C): this rank's token copies sorted by global expert id;
        ``counts`` (E,) int64: copies per global expert, summing to M. Returns (M, C):
        each copy's expert output in the order of ``routed``, differentiable w.r.t.
        ``routed`` and the experts' weights."""
        ...


def _check(routed: torch.Tensor, counts: torch.Tensor) -> None:
    if routed.dim() < 1 or int(counts.sum()) != routed.shape[0]:
        raise ValueError(f"the counts per expert sum to {int(counts.sum())} but "
                         f"{routed.shape[0] if routed.dim() else 0} token copies were routed")


class LocalDispatch:
    """Every expert on this rank (ep = 1): no exchange."""

    def __call__(self, routed, counts, experts):
        _check(routed, counts)
        return experts(routed, [int(n) for n in counts.tolist()])


class ExpertParallelDispatch:
    """Dispatch and combine over an expert-parallel group through ``transport``
    (``MPIAllToAll`` or ``device_alltoall.DeviceAllToAll``)."""

    def __init__(self, transport: AllToAll):
        self.transport = transport

    @staticmethod
    def of_world(comm, world) -> "TokenDispatch":
        """The dispatch over ``comm`` with ``world``'s device, GPU awareness and deadline:
        ``LocalDispatch`` on one rank; the device library's all-to-all under
        ``--comm.transport=xccl`` (its ``experts`` groups made by the grid first), else
        MPI's."""
        if comm.Get_size() == 1:
            return LocalDispatch()
        if world.collectives == "xccl":
            from hpctrain.parallel.experts.device_alltoall import DeviceAllToAll as kind
        else:
            kind = MPIAllToAll
        return ExpertParallelDispatch(kind(comm, timeout=world.timeout, accel=world.accel,
                                           aware=world.gpu_aware))

    def close(self) -> None:
        self.transport.close()

    def __call__(self, routed, counts, experts):
        _check(routed, counts)
        t = self.transport
        sent = permute.per_peer(counts.detach().cpu().to(torch.int64), t.size)
        received = t.counts(sent)  # (ep, L): rows from each source per local expert
        send_rows, recv_rows = permute.rows_per_peer(sent), permute.rows_per_peer(received)
        arrived = all_to_all(routed, t, send_rows, recv_rows, "dispatch")
        order = permute.expert_major_order(received, device=routed.device)
        # index_select, not x[order]: half the time, and its backward is an index_add
        out = experts(arrived.index_select(0, order), permute.rows_per_expert(received))
        back = out.index_select(0, permute.inverse(order))
        return all_to_all(back, t, recv_rows, send_rows, "combine")


def identity_experts(tokens: torch.Tensor, local_counts: list) -> torch.Tensor:
    """Experts that return their tokens: the exchange alone, for timing it."""
    return tokens


def dispatch_combine(dispatch: TokenDispatch, routed: torch.Tensor, counts: torch.Tensor,
                     experts: Experts = identity_experts) -> torch.Tensor:
    """One dispatch and combine of ``routed`` (forward only) through ``dispatch``, for a
    benchmark to time against ``torch.distributed.all_to_all_single`` with the same
    counts; with the default experts the result equals ``routed``."""
    with torch.no_grad():
        return dispatch(routed, counts, experts)
