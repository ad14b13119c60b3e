"""The GPT's shape, its parameter count and its training FLOPs, without torch.

``GPTConfig`` is the one description of a model: ``ModelConfig.to_gpt`` makes it from a
run's config, ``GPT`` is built from it, checkpoints record its ``shape()``, and the
performance model (``scaling/models.py``) counts with it. It lives apart from ``gpt.py``
so that the config, the planner and manifest checks use it without importing torch
(they run on login nodes, before MPI).
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

    def shape(self) -> dict:
        """Every field that fixes the parameters (all but dropout): what a checkpoint
        records and a resume must match."""
        return {k: getattr(self, k) for k in SHAPE_KEYS}

    @classmethod
    def from_shape(cls, record: dict) -> GPTConfig:
        """The model a ``shape()`` record describes (a checkpoint's; extra keys, such as a
        config section's dropout, are ignored). KeyError when one is missing."""
        return cls(**{k: record[k] for k in SHAPE_KEYS})

    def block_params(self) -> int:
        """Parameters of one transformer block."""
        c = self.n_embd
        n = 12 * c * c + 2 * c  # qkv 3C^2, proj C^2, MLP 8C^2, two LayerNorm weights
        if self.bias:
            n += 3 * c + c + 4 * c + c + 2 * c  # qkv, proj, MLP in and out, two LayerNorms
        return n

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters of ``GPT(self)``, the tied embedding and head once; the position
        embeddings are left out by default (they do no matrix multiply per token)."""
        c = self.n_embd
        n = self.n_layer * self.block_params() + self.vocab_size * c  # blocks, tied wte
        n += 2 * c if self.bias else c  # final LayerNorm
        return n if non_embedding else n + self.block_size * c

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the weights (forward 2N, backward 4N) plus
        12 L C T for attention scores and their weighted sum (Chinchilla/PaLM appendix B
        accounting, as in nanoGPT's MFU estimate)."""
        return (6.0 * self.num_params()
                + 12.0 * self.n_layer * self.n_embd * self.block_size)


SHAPE_KEYS = tuple(f.name for f in fields(GPTConfig) if f.name != "dropout")
"""The fields of ``GPTConfig.shape()``."""
