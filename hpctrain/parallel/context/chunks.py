"""Which tokens each context-parallel rank holds: causal load balancing (pure, no MPI).

A sequence of T tokens over cp ranks is cut into 2 cp equal chunks, and rank i holds
chunks i and 2 cp - 1 - i: an early chunk (few keys before it) paired with a late one
(many), so every rank computes the same number of causal (query, key) pairs. With a
contiguous split the last rank would do about (2 cp - 1) / cp times the average.
The picture and the exact counts: docs/design/context-parallel.md ("Load balancing").
"""

from __future__ import annotations

import torch

from hpctrain.errors import ConfigError


def check_length(T: int, cp: int) -> None:
    """Refuse a sequence that does not cut into 2 cp equal chunks."""
    if cp < 1:
        raise ConfigError(f"the context-parallel size must be at least 1, not {cp}")
    if T % (2 * cp):
        raise ConfigError(
            f"a sequence of {T} tokens does not cut into 2 x cp = {2 * cp} equal chunks "
            f"(context parallelism over {cp} ranks): use a sequence length that is a "
            f"multiple of {2 * cp}, or another cp")


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) that ``rank`` holds, in the order it keeps them."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in a context-parallel group of {cp}")
    return rank, 2 * cp - 1 - rank


def loader_parts(rank: int, cp: int) -> tuple[tuple[int, ...], int]:
    """(the chunks ``rank`` reads of each sequence, in its order; how many chunks a
    sequence is cut into): what the data loader reads for this rank. cp = 1: all of it."""
    return (rank_chunks(rank, cp), 2 * cp) if cp > 1 else ((0,), 1)


def chunk_size(T: int, cp: int) -> int:
    """Tokens per chunk: T / (2 cp)."""
    check_length(T, cp)
    return T // (2 * cp)


def positions(rank: int, cp: int, T: int) -> torch.Tensor:
    """The global token indices (int64, length T / cp) that ``rank`` holds, in its
    local order: what rotary or learned position embeddings must be given."""
    size = chunk_size(T, cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in rank_chunks(rank, cp)])


def split_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s part of ``x`` (B, T, ...) along ``dim``: its two chunks joined,
    (B, T / cp, ...), a new contiguous tensor."""
    size = chunk_size(x.size(dim), cp)
    return torch.cat([x.narrow(dim, c * size, size) for c in rank_chunks(rank, cp)], dim)


def gather_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of ``split_sequence``: every rank's part, in rank order, put back
    into the whole sequence."""
    cp = len(parts)
    pieces: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.size(dim) % 2:
            raise ValueError(f"rank {rank}'s part has {part.size(dim)} tokens, not two "
                             "equal chunks")
        first, second = part.chunk(2, dim)
        a, b = rank_chunks(rank, cp)
        pieces[a], pieces[b] = first, second
    return torch.cat(pieces, dim)


def causal_pairs(token_positions: torch.Tensor) -> int:
    """The (query, key) pairs a rank holding queries at ``token_positions`` computes
    under a causal mask: a query at position p attends to the p + 1 keys 0..p."""
    return int((token_positions + 1).sum())
