"""Rotary position embeddings (Su et al. 2021, "RoFormer"), as the Llama family uses them.

Each pair of channels (i, i + hs/2) of a query or key head is rotated by
``position * inv_freq[i]``, ``inv_freq[i] = theta ** (-2i / hs)``, so a query-key score
depends on their distance only. The pairing is Hugging Face's "rotate half", so the
published Llama weights load without a permutation. ``linear`` (position interpolation,
Chen et al. 2023) and ``llama3`` (Llama 3.1's rule) scaling stretch the frequencies for
longer contexts. ``docs/design/models.md`` ("Rotary embeddings").
"""

from __future__ import annotations

import math

import torch

from hpctrain.model.shape import parse_scaling


def inverse_frequencies(head_size: int, theta: float, scaling: str = "") -> torch.Tensor:
    """The hs/2 rotation frequencies, fp32."""
    inv = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
    kind, v = parse_scaling(scaling)
    if kind == "linear":
        inv = inv / v[0]
    elif kind == "llama3":
        factor, low, high, original = v
        wavelength = 2 * math.pi / inv
        scaled = torch.where(wavelength > original / low, inv / factor, inv)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelength >= original / high) & (wavelength <= original / low)
        inv = torch.where(between, blended, scaled)
    return inv.float()


class Rotary:
    """cos and sin tables for positions 0..T-1, made once per (T, device, dtype). Not a
    module and no buffers: the tables are derived, so checkpoints, ``.to(bf16)`` and
    ZeRO-3's parameter handling never see them, and the angles stay computed in fp32."""

    def __init__(self, head_size: int, theta: float, scaling: str = ""):
        self.inv_freq = inverse_frequencies(head_size, theta, scaling)
        self._tables: dict = {}

    def tables(self, T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Eager code keeps the last tables; compiled code computes them in its graph
        every call, so that a recomputed block (``--model.recompute``) traces the same
        graph as its first forward, which a cache filled by that forward would not."""
        if torch.compiler.is_compiling():
            return self._make(T, device, dtype)
        key = (T, str(device), dtype)
        if key not in self._tables:
            self._tables = {key: self._make(T, device, dtype)}
        return self._tables[key]

    def _make(self, T: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables_at(torch.arange(T, device=device), dtype)

    def tables_at(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The (len(positions), hs) cos and sin tables of the given token positions
        (context parallelism: a rank's tokens, ``parallel/context/apply.py``)."""
        angles = torch.outer(positions.to(torch.float32), self.inv_freq.to(positions.device))
        angles = torch.cat([angles, angles], dim=-1)  # (T, hs): both halves of a pair
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(self, x: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """Rotate (B, heads, T, hs) by each position's angles; ``cos_sin``: the (T, hs)
        tables of other positions than 0..T-1 (context parallelism), ``tables_at``'s."""
        cos, sin = cos_sin or self.tables(x.size(-2), x.device, x.dtype)
        half = x.size(-1) // 2
        rotated_half = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated_half * sin
