"""The GPT's shape, its parameter count and its training FLOPs, without torch.

``GPTConfig`` is the one description of a model: ``ModelConfig.to_gpt`` makes it from a
run's config, ``GPT`` is built from it, checkpoints record its ``shape()``, and the
performance model (``scaling/models.py``) counts with it. It lives apart from ``gpt.py``
so that the config, the planner and manifest checks use it without importing torch
(they run on login nodes, before MPI).

The vocabulary may be padded: ``vocab_multiple`` rounds the rows of the embedding and
the head up (50257 -> 50304 for GPT-2 at 64), so the head's matrix multiply gets a width
that GPU kernels tile without a ragged edge (as nanoGPT pads its GPT-2). The
padded rows are parameters (memory, optimizer state, checkpoints count them) but never
a token: ``gpt.py`` cuts their logits off, so they get no gradient and are never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    vocab_multiple: int = 1
    """Pad the embedding and head rows up to a multiple of this (1: no padding)."""
    recompute: str = "none"
    """'block': keep only each block's input in forward and run the block again in
    backward (activation recomputation); 'none' keeps every activation."""

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token embedding and the tied head: ``vocab_size`` rounded up to a
        multiple of ``vocab_multiple``."""
        m = self.vocab_multiple
        return -(-self.vocab_size // m) * m

    def shape(self) -> dict:
        """Every field that fixes the parameters (all but dropout and recompute): what a
        checkpoint records and a resume must match."""
        return {k: getattr(self, k) for k in SHAPE_KEYS}

    @classmethod
    def from_shape(cls, record: dict) -> GPTConfig:
        """The model a ``shape()`` record describes (a checkpoint's; extra keys, such as a
        config section's dropout, are ignored). KeyError when one is missing, except
        ``vocab_multiple``: records written before vocabulary padding existed lack it and
        describe unpadded models (1)."""
        return cls(**{k: record[k] for k in SHAPE_KEYS if k != "vocab_multiple"},
                   vocab_multiple=record.get("vocab_multiple", 1))

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        c = self.n_embd
        n = 12 * c * c + 2 * c  # qkv 3C^2, proj C^2, MLP 8C^2, two LayerNorm weights
        if self.bias:
            n += 3 * c + c + 4 * c + c + 2 * c  # qkv, proj, MLP in and out, two LayerNorms
        return n

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters of ``GPT(self)``, the tied embedding and head once (padded rows
        included: they take memory like any other); the position embeddings are left out
        by default (they do no matrix multiply per token)."""
        c = self.n_embd
        n = self.n_layer * self.block_params() + self.padded_vocab_size * c  # blocks, wte
        n += 2 * c if self.bias else c  # final LayerNorm
        return n if non_embedding else n + self.block_size * c

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the weights (forward 2N, backward 4N) plus
        12 L C T for attention scores and their weighted sum (Chinchilla/PaLM appendix B
        accounting, as in nanoGPT's MFU estimate). N counts the real vocabulary only: the
        padded rows' logits are computed and thrown away, work that MFU must not credit."""
        padding = (self.padded_vocab_size - self.vocab_size) * self.n_embd
        return (6.0 * (self.num_params() - padding)
                + 12.0 * self.n_layer * self.n_embd * self.block_size)


SHAPE_KEYS = tuple(f.name for f in fields(GPTConfig) if f.name not in ("dropout", "recompute"))
"""The fields of ``GPTConfig.shape()``."""
