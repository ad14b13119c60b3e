"""Cut a GPT into pipeline stages by layers.

The embeddings go with the first chunk, the blocks are shared out as evenly as possible,
and the final norm, the head and the loss go with the last chunk (chunk g on stage
g mod p, or placed in a V for zbv). A stage keeps the model's own parameter names, which
the family's plan gives (``model/plan.py``), and runs the model's own code, so it
computes exactly what the whole model does. A tied head's embedding is a copy on the
last stage whose gradient goes to the first: the optimizer, the gradient norm and the
checkpoint see the embedding once. ``docs/design/pipeline.md`` ("Stages").
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hpctrain.model.gpt import GPT, EmbeddingAndHead
from hpctrain.parallel.pipeline.zbv import CHUNKS as ZBV_CHUNKS, v_global_chunk


def layer_split(n_layer: int, n_chunks: int) -> list[range]:
    """Contiguous layer ranges, one per chunk, sizes differing by at most one."""
    if n_chunks > n_layer:
        raise ValueError(f"{n_layer} layers cannot fill {n_chunks} pipeline chunks")
    base, extra = divmod(n_layer, n_chunks)
    out, start = [], 0
    for c in range(n_chunks):
        size = base + (1 if c < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class PipelineStage(EmbeddingAndHead, nn.Module):
    """One stage's chunks of a GPT. ``chunk_forward(c, x, targets)`` runs local chunk c."""

    def __init__(self, gpt: GPT, stage: int, n_stages: int, virtual: int = 1,
                 device: torch.device | str | None = None, v_shape: bool = False):
        super().__init__()
        self.cfg = gpt.cfg
        self.tensor_parallel = gpt.tensor_parallel  # its ends, when the layers are split
        if v_shape:
            virtual = ZBV_CHUNKS
        self.stage, self.n_stages, self.virtual = stage, n_stages, virtual
        splits = layer_split(gpt.cfg.n_layer, n_stages * virtual)
        chunks = [v_global_chunk(stage, c, n_stages) if v_shape else c * n_stages + stage
                  for c in range(virtual)]
        self.chunk_layers = [list(splits[g]) for g in chunks]
        self.has_embedding = stage == 0
        self.has_head = stage == (0 if v_shape else n_stages - 1)
        plan = gpt.plan
        if self.has_embedding:
            for name in plan.embedding:
                if name in gpt._modules:  # a family may have no learned positions
                    setattr(self, name, gpt.get_submodule(name))
        blocks = gpt.get_submodule(plan.blocks)
        setattr(self, plan.blocks, nn.ModuleDict(
            {str(i): blocks[i] for layers in self.chunk_layers for i in layers}))
        if self.has_head:
            for name in plan.head_modules(self.cfg.tie_embeddings):
                setattr(self, name, gpt.get_submodule(name))
        # Only this stage goes to the device: the whole model need not fit there.
        if device is not None:
            self.to(device)
        self.head_copy = None
        if self.has_head and self.cfg.tie_embeddings and not self.has_embedding:
            # The head's copy of the tied embedding (see the module docstring).
            tied = gpt.get_submodule(plan.token_embedding).weight
            self.head_copy = tied.detach().to(device).clone().requires_grad_(True)

    @property
    def embedding_weight(self) -> torch.Tensor:
        """The token embedding's matrix (first stage): the one a tied head shares."""
        return self.get_submodule(self.plan.token_embedding).weight

    @property
    def head_weight(self) -> torch.Tensor:
        """The head's matrix: the tied embedding (or its copy), or the head's own."""
        if self.head_copy is not None:
            return self.head_copy
        if self.cfg.tie_embeddings:
            return self.embedding_weight
        return self.get_submodule(self.plan.head).weight

    def is_first_chunk(self, chunk: int) -> bool:
        return self.has_embedding and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.has_head and chunk == self.virtual - 1

    def chunk_forward(self, chunk: int, x: torch.Tensor,
                      targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first chunk) or the residual stream in; the residual stream, or the
        mean loss (last chunk, with targets) out."""
        if self.is_first_chunk(chunk):
            x = self.embed(x)
        blocks = self.get_submodule(self.plan.blocks)
        for i in self.chunk_layers[chunk]:
            x = blocks[str(i)](x)
        if self.is_last_chunk(chunk):
            return self.head_loss(x, targets)
        return x

    def sync_head_dtype(self) -> None:
        """Give the head's copy the compute dtype the engine gave the parameters (bf16)."""
        if self.head_copy is not None:
            dtype = next(self.parameters()).dtype
            if self.head_copy.dtype != dtype:
                self.head_copy = self.head_copy.detach().to(dtype).requires_grad_(True)

    def activation_shape(self, rows: int, seq: int) -> tuple[int, int, int]:
        """What crosses a stage boundary: the residual stream, or under sequence
        parallelism this rank's tokens of it."""
        tp = self.tensor_parallel
        if tp is not None and tp.sequence_parallel:
            seq //= tp.group.size
        return (rows, seq, self.cfg.n_embd)
