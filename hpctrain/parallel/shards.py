"""Where each rank's shard of a flat parameter buffer lies: one pure function for ZeRO.

A ZeRO bucket's flat buffer is padded to a multiple of the data-parallel size N and rank
r gets the contiguous slice ``[r*s, (r+1)*s)`` with ``s = padded / N`` (as Megatron's
distributed optimizer and DeepSpeed's ZeRO do): equal slices are what
``MPI_Reduce_scatter_block`` and ``MPI_Allgather`` need. ``pieces(r)`` lists the pieces
of tensors in a shard, each its own 1-D tensor for the optimizer.
The layout and its edge cases: docs/design/zero.md ("Shards").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """The part of tensor ``index`` that lies in one rank's shard."""

    index: int
    """Which tensor (position in the layout's ``numels``)."""
    tensor_start: int
    """First element of the piece within the flattened tensor."""
    shard_start: int
    """First element of the piece within the rank's shard."""
    length: int


@dataclass(frozen=True)
class ShardLayout:
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    """Start of each tensor in the flat (unpadded) buffer."""
    world: int
    shard: int
    """Elements per rank; ``shard * world`` is the padded buffer length."""

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def padded(self) -> int:
        return self.shard * self.world

    def rank_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of ``rank``'s shard in the padded flat buffer."""
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[Piece]:
        lo, hi = self.rank_range(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start, stop = max(lo, off), min(hi, off + n)
            if start < stop:
                out.append(Piece(i, start - off, start - lo, stop - start))
        return out


def shard_layout(numels: list[int], world: int, align: int = 1) -> ShardLayout:
    """Lay ``numels`` out back to back and split them into ``world`` equal shards.

    ``align`` rounds the shard length up to a multiple of it (e.g. 16 elements keeps every
    shard 64-byte aligned in fp32, which vectorized optimizer kernels like).
    """
    if world < 1 or align < 1:
        raise ValueError(f"world ({world}) and align ({align}) must be >= 1")
    if any(n < 0 for n in numels):
        raise ValueError("tensor sizes must be >= 0")
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += n
    shard = max(1, -(-pos // world))  # ceil; at least one element so buffers exist
    shard = -(-shard // align) * align
    return ShardLayout(tuple(numels), tuple(offsets), world, shard)
