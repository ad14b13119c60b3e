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


FUSED = True
"""On the CPU, compute whole blocks with torch's fused flash-attention kernel, which
returns the lse too (``_scaled_dot_product_flash_attention_for_cpu`` and its backward);
the matrix-multiply path below serves other devices and query tiles (and the tests)."""


def fused(q: torch.Tensor) -> bool:
    """Whether blocks of ``q`` run on torch's fused CPU kernel."""
    return FUSED and q.device.type == "cpu"


def _whole_heads(kv: torch.Tensor, n_head: int) -> torch.Tensor:
    """(B, nkv, L, hs) -> (B, nh, L, hs), fp32: each key/value head repeated for its
    queries (the fused kernel takes equal head counts)."""
    kv = kv.float()
    return kv if kv.size(1) == n_head else kv.repeat_interleave(n_head // kv.size(1), dim=1)


def _fold(grad: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """(B, nh, L, hs) -> (B, nkv, L, hs): the gradients of a key/value head's copies summed."""
    B, nh, L, hs = grad.shape
    return grad.view(B, n_kv_head, nh // n_kv_head, L, hs).sum(2)


def _fused_block(q, k, v, diagonal: bool, offset: int) -> bool:
    """A whole block (no query tile) the fused kernel computes: its causal mask is the
    top-left one, which is the diagonal's only for whole chunks."""
    return fused(q) and offset == 0 and (not diagonal or q.size(-2) == k.size(-2))


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


def _grouped(t: torch.Tensor, n_kv_head: int) -> torch.Tensor:
    """(B, nh, L, ...) -> (B, nkv, nh / nkv * L, ...), fp32: the query heads that share a
    key/value head side by side (head h reads key/value head h // (nh / nkv)), so one
    matrix multiply serves them all and no key/value head is copied."""
    return t.float().reshape(t.size(0), n_kv_head, -1, *t.shape[3:])


def _ungrouped(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of ``_grouped``: (B, nkv, nh / nkv * L, ...) -> (B, nh, L, ...)."""
    return t.reshape(t.size(0), n_head, -1, *t.shape[3:])


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool,
            offset: int = 0) -> torch.Tensor:
    """q k^T * scale, grouped (B, nkv, nh / nkv * Lq, Lk), fp32; on the diagonal, -inf
    above it, the queries being the chunk's rows ``offset``.. (a tile of them)."""
    s = torch.matmul(_grouped(q, k.size(1)), k.float().transpose(-2, -1)) * scale
    if diagonal:
        Lq, Lk = q.size(-2), k.size(-2)
        above = torch.ones(Lq, Lk, dtype=torch.bool, device=s.device).triu(1 + offset)
        s = s.masked_fill(above.repeat(q.size(1) // k.size(1), 1), float("-inf"))
    return s


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           diagonal: bool, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` on the keys ``k`` alone: (out (B, nh, Lq, hs),
    lse (B, nh, Lq)), both fp32. ``diagonal``: query j sees keys 0..j + ``offset`` only
    (the chunks hold the same positions; ``offset``: the queries are the chunk's rows
    from ``offset`` on, a tile of them)."""
    if _fused_block(q, k, v, diagonal, offset):
        nh = q.size(1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float().contiguous(), _whole_heads(k, nh).contiguous(),
            _whole_heads(v, nh).contiguous(), 0.0, diagonal, scale=scale)
        return out, lse.float()
    s = _scores(q, k, scale, diagonal, offset)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    nh = q.size(1)
    return _ungrouped(torch.matmul(p, v.float()), nh), _ungrouped(lse, nh)


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
                    offset: int = 0, out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of (dq, dk, dv), fp32, recomputed from the inputs and the
    *final* ``lse`` of the queries (over every key), with ``delta`` = rowsum(dout * out)
    of the final output. dk and dv come back with the key/value heads' shape. With the
    final output ``out`` a whole block runs on the fused kernel, which computes delta
    from it."""
    if out is not None and _fused_block(q, k, v, diagonal, offset):
        nh, nkv = q.size(1), k.size(1)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.float().contiguous(), q.float().contiguous(), _whole_heads(k, nh).contiguous(),
            _whole_heads(v, nh).contiguous(), out.float().contiguous(),
            lse.float().contiguous(), 0.0, diagonal, scale=scale)
        return dq, _fold(dk, nkv), _fold(dv, nkv)
    nh, nkv = q.size(1), k.size(1)
    dout = _grouped(dout, nkv)
    p = torch.exp(_scores(q, k, scale, diagonal, offset)
                  - _grouped(lse, nkv).unsqueeze(-1))  # (B, nkv, nh / nkv * Lq, Lk)
    dv = torch.matmul(p.transpose(-2, -1), dout)  # the group's shares summed
    dp = torch.matmul(dout, v.float().transpose(-2, -1))
    ds = p * (dp - _grouped(delta, nkv).unsqueeze(-1))
    dq = _ungrouped(torch.matmul(ds, k.float()), nh) * scale
    dk = torch.matmul(ds.transpose(-2, -1), _grouped(q, nkv)) * scale
    return dq, dk, dv
