"""The index arithmetic of dispatch and combine, pure and tested alone.

A rank's routed copies are expert-major over the ``E`` global experts; rank ``r`` of an
``ep``-rank group holds experts ``[r L, (r + 1) L)`` with ``L = E / ep``. After the
exchange a rank holds its rows source-major (source 0's rows for local experts
``0..L-1``, then source 1's, ...); its experts want them expert-major (expert 0's rows
from source 0, 1, ..., then expert 1's, ...). ``counts`` below is always the (ep, L)
table of a rank's view: row ``p`` is peer ``p``, column ``j`` local expert ``j``.
"""

from __future__ import annotations

import torch


def per_peer(counts: torch.Tensor, ep: int) -> torch.Tensor:
    """A rank's (E,) copies per global expert as the (ep, L) table of what it sends to
    each peer, one row per peer's experts; ``E`` must be a multiple of ``ep``."""
    if counts.dim() != 1 or counts.numel() % ep:
        raise ValueError(f"{counts.numel()} experts cannot be split over {ep} "
                         "expert-parallel ranks: the number of experts must be a "
                         "multiple of ep")
    return counts.reshape(ep, counts.numel() // ep)


def rows_per_peer(table: torch.Tensor) -> list[int]:
    """Rows exchanged with each peer (the all-to-all's split sizes)."""
    return [int(n) for n in table.sum(1).tolist()]


def rows_per_expert(table: torch.Tensor) -> list[int]:
    """Rows each local expert receives, over every source."""
    return [int(n) for n in table.sum(0).tolist()]


def expert_major_order(table: torch.Tensor, device=None) -> torch.Tensor:
    """The index that takes source-major received rows to expert-major ones:
    ``grouped = received[order]``. ``table``: rows received from each source (ep, L)."""
    sizes = table.to(torch.int64)
    arrived_at = (sizes.reshape(-1).cumsum(0) - sizes.reshape(-1)).reshape(sizes.shape)
    blocks = sizes.t().reshape(-1)  # the blocks in expert-major order
    starts = arrived_at.t().reshape(-1)
    grouped_at = blocks.cumsum(0) - blocks
    total = int(blocks.sum())
    # row i of the grouped rows: its block's arrival start + its place in the block
    order = (torch.arange(total) - grouped_at.repeat_interleave(blocks)
             + starts.repeat_interleave(blocks))
    return order.to(device) if device is not None else order


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The index undoing ``order``: ``x[order][inverse(order)] == x``."""
    out = torch.empty_like(order)
    out[order] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return out
