"""Context parallelism on a model: every attention of a GPT runs as ring attention over
the group, and the positions (learned or rotary) are each token's global index.

The model imports no MPI: this module sets the two hooks the model leaves for it,
``CausalSelfAttention.context`` and ``EmbeddingAndHead.token_positions``, and wraps each
rotary embedding so that it rotates this rank's tokens by their true positions. Every
other layer is per token and runs unchanged on the rank's T / cp tokens.
docs/design/context-parallel.md ("In training").
"""

from __future__ import annotations

import torch

from hpctrain.model.common.layers import CausalSelfAttention
from hpctrain.model.gpt import EmbeddingAndHead
from hpctrain.parallel.context import chunks
from hpctrain.parallel.context.ring import Ring
from hpctrain.parallel.context.ring_attention import ring_attention


class _Positions:
    """This rank's global token positions for a local length, cached per (L, device)."""

    def __init__(self, rank: int, cp: int):
        self.rank, self.cp = rank, cp
        self._cache: dict = {}

    def __call__(self, local: int, device) -> torch.Tensor:
        key = (local, str(device))
        if key not in self._cache:
            self._cache = {key: chunks.positions(self.rank, self.cp, local * self.cp)
                           .to(device)}
        return self._cache[key]


class RingContext:
    """``CausalSelfAttention.context``: causal attention of this rank's tokens over the
    whole sequence, by ring attention over ``ring``."""

    def __init__(self, ring: Ring):
        self.ring = ring

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, self.ring)


class GlobalRotary:
    """A rotary embedding that rotates a rank's T / cp tokens by their global positions,
    not by 0..T/cp - 1: the tables of those positions alone, made once per (T / cp,
    device, dtype) and shared by the queries and keys of every step."""

    def __init__(self, rotary, positions: _Positions):
        self.rotary, self.positions = rotary, positions
        self._tables: dict = {}

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        local = x.size(-2)
        key = (local, str(x.device), x.dtype)
        if key not in self._tables:
            self._tables = {key: self.rotary.tables_at(self.positions(local, x.device),
                                                       x.dtype)}
        return self.rotary.rotate(x, self._tables[key])


def context_parallelize(model: torch.nn.Module, ring: Ring) -> int:
    """Make ``model`` (a GPT, or its tensor-parallel part) compute on this rank's part
    of each sequence (``chunks.split_sequence``): ring attention in every block, global
    positions at the embedding and in every rotary embedding. Returns how many
    attentions now run over the ring. A ring of one rank changes nothing."""
    if ring.size == 1:
        return 0
    positions = _Positions(ring.rank, ring.size)
    attentions = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for layer in attentions:
        layer.context = RingContext(ring)
        if layer.rotary is not None:
            layer.rotary = GlobalRotary(layer.rotary, positions)
    if isinstance(model, EmbeddingAndHead):  # learned positions read it; rotary ones do not
        model.token_positions = positions
    return len(attentions)
