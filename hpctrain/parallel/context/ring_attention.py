"""Causal attention over a sequence split across a context-parallel ring (Liu et al.
2023, "Ring Attention with Blockwise Transformers"; the load-balanced causal form of
Megatron-LM's and TransformerEngine's context parallelism).

Each rank keeps its queries (its two chunks, ``chunks.py``); the key/value blocks
travel around the ring, each rank's next block posted before the current one is
computed, and the partial results merge exactly by their log-sum-exp (``blocks.py``).
Backward recomputes every block from the saved queries, output and log-sum-exp, with
the blocks travelling the other way round, each carrying its dk and dv, so that every
block ends its journey on its owner with its whole gradient.
The ring, the merge and the schedule of both passes: docs/design/context-parallel.md.
"""

from __future__ import annotations

import math

import torch

from hpctrain.errors import ConfigError
from hpctrain.parallel.context import blocks
from hpctrain.parallel.context.ring import Ring

KV_TAG, GRAD_TAG = 4201, 4202
"""Message tags: key/value blocks, and their gradients (the same neighbours exchange both)."""
QUERY_TILE = 128
"""Queries computed at a time within a chunk pair on the matrix-multiply path: the
scores, probabilities and their gradients are (B, nh, QUERY_TILE, chunk) at most, not
(B, nh, chunk, chunk), so attention's memory grows with the sequence, not its square.
The fused CPU kernel (``blocks.fused``) tiles inside itself and takes whole chunks."""


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, *,
                   scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries on the whole sequence's keys.

    ``q`` (B, nh, L, hs), ``k`` and ``v`` (B, nkv, L, hs): this rank's L = T / cp tokens
    in the load-balanced order (``chunks.split_sequence``), rotary positions already
    applied with ``chunks.positions``; nkv divides nh (grouped-query attention; k and v
    travel with nkv heads). Returns (B, nh, L, hs) in ``q``'s dtype, equal to
    ``F.scaled_dot_product_attention(..., is_causal=True)`` of the whole sequence
    restricted to this rank's tokens. Collective over ``ring``: every rank calls it.
    Attention dropout is not supported (it would need the same random mask in the
    recomputation of backward): ``dropout_p`` other than 0 raises ``ConfigError``."""
    if dropout_p:
        raise ConfigError(
            f"attention dropout ({dropout_p:g}) is not supported with context parallelism "
            "(ring attention): set the model's dropout to 0")
    _check_shapes(q, k, v)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, scale)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring attention takes q (B, nh, L, hs) and k, v (B, nkv, L, hs) "
                         f"of one shape, not {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, nh, L, hs = q.shape
    if (k.size(0), k.size(2), k.size(3)) != (B, L, hs) or nh % k.size(1):
        raise ValueError(f"keys {tuple(k.shape)} do not fit queries {tuple(q.shape)}: the "
                         "same batch, tokens and head size, key/value heads dividing nh")
    if L % 2:
        raise ValueError(f"{L} local tokens are not two equal chunks (chunks.py)")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float):
        out, lse, last_kv = _forward(q, torch.stack([k, v]), ring, scale)
        ctx.save_for_backward(q, out, lse, last_kv)
        ctx.ring, ctx.scale, ctx.kv_dtype = ring, scale, k.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, last_kv = ctx.saved_tensors
        dq, dkv = _backward(dout, q, out, lse, last_kv, ctx.ring, ctx.scale)
        return dq.to(q.dtype), dkv[0].to(ctx.kv_dtype), dkv[1].to(ctx.kv_dtype), None, None


def _half(t: torch.Tensor, h: int, dim: int = -2) -> torch.Tensor:
    """The first (0) or second (1) chunk of ``t``, whose tokens are dimension ``dim``
    (-2 for queries, keys and outputs; -1 for a log-sum-exp), as a view."""
    n = t.size(dim) // 2
    return t.narrow(dim, h * n, n)


def _tiles(pairs, chunk: int, tile: int):
    """(query half, key half, diagonal, first query row, rows, keys) of every query tile
    of every chunk pair: on the diagonal a tile's queries see the keys up to their own
    position only, so the keys after them are not computed at all."""
    for qh, kh, diagonal in pairs:
        for lo in range(0, chunk, tile):
            rows = min(tile, chunk - lo)
            yield qh, kh, diagonal, lo, rows, lo + rows if diagonal else chunk


def _rows(t: torch.Tensor, lo: int, n: int, dim: int = -2) -> torch.Tensor:
    return t.narrow(dim, lo, n)


def _tile(q: torch.Tensor) -> int:
    """Queries per tile: whole chunks on the fused kernel, else QUERY_TILE."""
    chunk = q.size(-2) // 2
    return chunk if blocks.fused(q) else QUERY_TILE


def _forward(q, kv, ring: Ring, scale: float):
    """(out in q's dtype, lse fp32 (B, nh, L), the last key/value block seen). Step s
    computes on the block of rank (rank - s) while that block moves on one place."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(ring.size):
        source = ring.neighbour(-step)
        transfer = None
        if step < ring.size - 1:
            transfer = ring.shift(kv, +1, KV_TAG, f"key/value block of step {step + 1}")
        pairs = blocks.chunk_pairs(ring.rank, source, ring.size)
        for qh, kh, diagonal, lo, n, keys in _tiles(pairs, q.size(-2) // 2, _tile(q)):
            o, l = blocks.attend(_rows(_half(q, qh), lo, n), _rows(_half(kv[0], kh), 0, keys),
                                 _rows(_half(kv[1], kh), 0, keys), scale, diagonal, lo)
            out_t, lse_t = _rows(_half(out, qh), lo, n), _rows(_half(lse, qh, -1), lo, n, -1)
            o_acc, l_acc = blocks.merge(out_t, lse_t, o, l)
            out_t.copy_(o_acc)
            lse_t.copy_(l_acc)
        if transfer is not None:
            kv = transfer.wait()
    return out.to(q.dtype), lse, kv


def _backward(dout, q, out, lse, kv, ring: Ring, scale: float):
    """(dq, dkv of this rank's own block), fp32. The blocks go round the other way,
    starting from the one forward ended with: step s computes on rank (rank + 1 + s)'s
    block, so the last step is on this rank's own. A block's dk/dv so far arrives from
    the rank behind while this step computes its own share."""
    delta = (dout.float() * out.float()).sum(-1)  # (B, nh, L)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    incoming = None  # this step's block's gradient so far, on its way
    for step in range(ring.size):
        source = ring.neighbour(1 + step)
        last = step == ring.size - 1
        transfer = None if last else ring.shift(kv, -1, KV_TAG,
                                               f"key/value block of backward step {step + 1}")
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        pairs = blocks.chunk_pairs(ring.rank, source, ring.size)
        for qh, kh, diagonal, lo, n, keys in _tiles(pairs, q.size(-2) // 2, _tile(q)):
            dq_part, dk_part, dv_part = blocks.attend_backward(
                _rows(_half(q, qh), lo, n), _rows(_half(kv[0], kh), 0, keys),
                _rows(_half(kv[1], kh), 0, keys), _rows(_half(dout, qh), lo, n),
                _rows(_half(lse, qh, -1), lo, n, -1), _rows(_half(delta, qh, -1), lo, n, -1),
                scale, diagonal, lo, _rows(_half(out, qh), lo, n))
            _rows(_half(dq, qh), lo, n).add_(dq_part)
            _rows(_half(dkv[0], kh), 0, keys).add_(dk_part)
            _rows(_half(dkv[1], kh), 0, keys).add_(dv_part)
        if incoming is not None:
            dkv += incoming.wait()
        if not last:
            incoming = ring.shift(dkv, -1, GRAD_TAG, f"key/value gradient of step {step + 1}")
            kv = transfer.wait()
    return dq, dkv
