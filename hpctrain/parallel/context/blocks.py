"""Attention of one query chunk on one key/value chunk, its exact merge with the others
(online softmax), and its backward recomputed from the log-sum-exp (pure, no MPI).

A block returns its output normalised over its own keys and the log-sum-exp ``lse`` of
its scores; two blocks over disjoint keys merge exactly (Milakov and Gimelshein 2018,
"Online normalizer calculation for softmax"; Dao et al. 2022, FlashAttention):

    lse = log(exp(lse_1) + exp(lse_2)),   out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2

Backward needs no stored probabilities: P = exp(S - lse) with the final lse, and with
D = rowsum(dO * O), dS = P * (dO V^T - D). Derivations: docs/design/context-parallel.md.
Shapes: q (B, nh, Lq, hs); k, v (B, nkv, Lk, hs) with nkv dividing nh (grouped-query
attention: query head h reads key/value head h // (nh / nkv), as torch's ``enable_gqa``).
All arithmetic is fp32 whatever the inputs' dtype.
"""

from __future__ import annotations

import enum

import torch

from hpctrain.parallel.context import chunks


class Relation(enum.Enum):
    """How a key chunk lies against a query chunk under the causal mask."""

    SKIP = "skip"          # every key after every query: nothing to compute
    DIAGONAL = "diagonal"  # the same positions: the lower triangle
    FULL = "full"          # every key before every query: no mask


def relation(query_chunk: int, key_chunk: int) -> Relation:
    """The causal relation of two equal chunks by their global chunk indices."""
    if key_chunk > query_chunk:
        return Relation.SKIP
    return Relation.DIAGONAL if key_chunk == query_chunk else Relation.FULL


def chunk_pairs(rank: int, source: int, cp: int):
    """(query half, key half, diagonal) for every pair of ``rank``'s two query chunks and
    ``source``'s two key chunks that the causal mask leaves anything of."""
    mine, theirs = chunks.rank_chunks(rank, cp), chunks.rank_chunks(source, cp)
    for qh, q_chunk in enumerate(mine):
        for kh, k_chunk in enumerate(theirs):
            rel = relation(q_chunk, k_chunk)
            if rel is not Relation.SKIP:
                yield qh, kh, rel is Relation.DIAGONAL


def _expand(kv: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, nkv, L, hs) -> (B, nh, L, hs): each key/value head repeated for its queries."""
    group = n_head // kv.size(1)
    return kv.float() if group == 1 else kv.float().repeat_interleave(group, dim=1)


def _fold(grad: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """(B, nh, L, hs) -> (B, nkv, L, hs): the gradients of a key/value head's copies summed."""
    B, nh, L, hs = grad.shape
    return grad.view(B, n_kv_head, nh // n_kv_head, L, hs).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool,
            offset: int = 0) -> torch.Tensor:
    """q k^T * scale (B, nh, Lq, Lk), fp32; on the diagonal, -inf above it, the queries
    being the chunk's rows ``offset``.. (a tile of them)."""
    s = torch.matmul(q.float(), _expand(k, q.size(1)).transpose(-2, -1)) * scale
    if diagonal:
        Lq, Lk = s.shape[-2:]
        above = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).triu(1 + offset)
        s = s.masked_fill(above, float("-inf"))
    return s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           diagonal: bool, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` on the keys ``k`` alone: (out (B, nh, Lq, hs),
    lse (B, nh, Lq)), both fp32. ``diagonal``: query j sees keys 0..j + ``offset`` only
    (the chunks hold the same positions; ``offset``: the queries are the chunk's rows
    from ``offset`` on, a tile of them)."""
    s = _scores(q, k, scale, diagonal, offset)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, _expand(v, q.size(1))), lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the keys of both: ``out``/``lse`` so far (lse -inf where no
    key was seen yet) merged with a block's, each output rescaled by its share of the
    joint normaliser."""
    new_lse = torch.logaddexp(lse, block_lse)
    new_out = (out * torch.exp(lse - new_lse).unsqueeze(-1)
               + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    return new_out, new_lse


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, scale: float, diagonal: bool,
                    offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), fp32, recomputed from the inputs and the
    *final* ``lse`` of the queries (over every key), with ``delta`` = rowsum(dout * out)
    of the final output. dk and dv come back with the key/value heads' shape."""
    k_all, v_all = _expand(k, q.size(1)), _expand(v, q.size(1))
    dout = dout.float()
    p = torch.exp(_scores(q, k, scale, diagonal, offset) - lse.unsqueeze(-1))  # (B, nh, Lq, Lk)
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v_all.transpose(-2, -1))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k_all) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.float()) * scale
    return dq, _fold(dk, k.size(1)), _fold(dv, k.size(1))
