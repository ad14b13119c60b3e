"""``tensor_parallelize(gpt, group)``: turn a whole GPT into this rank's tensor-parallel
part of it, in place.

Every rank built the whole model from the same seed, so each keeps its slice of the
very numbers the single-process model holds (``layout.py`` says which slice), and the
layers that replace the GPT's exchange activations over the group (``layers.py``):

- in every block, ``attn.c_attn`` and ``mlp.c_fc`` become column-parallel and the two
  ``c_proj`` row-parallel; the attention computes its share of the heads
  (n_head / tp query heads, n_kv_head / tp key/value heads);
- ``wte`` becomes vocabulary-parallel, and the head (the same slice when tied, its own
  when not) scores this rank's slice of the vocabulary; the loss never gathers the
  logits (``cross_entropy.py``);
- with ``sequence_parallel`` the residual stream between the tensor-parallel layers is
  cut along the sequence (``mappings.py``): the norms, the residual additions and the
  output projections' biases work on T / tp tokens per rank, and the whole-tensor
  parameters used there get their gradients summed over the group.

What changes at the model's two ends is the ``TensorParallel`` object installed as
``gpt.tensor_parallel`` (read by ``EmbeddingAndHead``). Dropout is refused: the split
heads and tokens would need a random stream per rank that still reproduces the
single-process masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.group import TensorParallelGroup
from hpctrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding, split_parameter)
from hpctrain.parallel.tensor.layout import TensorParallelError, check_splittable, shard_spec
from hpctrain.parallel.tensor.mappings import (copy_to_group, gather_from_sequence,
                                               scatter_to_sequence, sum_gradient_over_group)


class TensorParallel:
    """The two ends of a tensor-parallel GPT (see ``EmbeddingAndHead.tensor_parallel``)."""

    def __init__(self, group: TensorParallelGroup, cfg: GPTConfig, sequence_parallel: bool):
        self.group, self.cfg, self.sequence_parallel = group, cfg, sequence_parallel
        rows = cfg.padded_vocab_size // group.size
        self.vocab_start = group.rank * rows
        self.vocab_real = min(max(cfg.vocab_size - self.vocab_start, 0), rows)
        """Rows of this rank's slice that are real tokens (the rest pad the vocabulary)."""

    def enter_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens (B, T, C), whole on every rank -> the blocks' input."""
        return scatter_to_sequence(x, self.group) if self.sequence_parallel else x

    def head_loss(self, model, h: torch.Tensor, targets: torch.Tensor | None):
        """Final norm, this rank's slice of the head, and the loss over the group; without
        targets, the last position's logits over the whole vocabulary (B, 1, V)."""
        h = model.ln_f(h)
        h = (gather_from_sequence(h, self.group) if self.sequence_parallel
             else copy_to_group(h, self.group))
        if targets is None:
            mine = F.linear(h[:, [-1], :], model.head_weight)
            return self.group.all_gather(mine, dim=-1)[..., :self.cfg.vocab_size]
        return vocab_parallel_cross_entropy(h, model.head_weight, targets, self.group,
                                            self.vocab_start, self.vocab_real,
                                            self.cfg.loss_chunk)

    def describe(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        return (f"tensor parallel over {self.group.size} ranks ({self.group.backend}{sp}): "
                f"rank {self.group.rank} holds vocabulary rows {self.vocab_start}.."
                f"{self.vocab_start + self.vocab_real - 1}")


def check_tensor_parallel(cfg: GPTConfig, tp: int, sequence_parallel: bool) -> None:
    """Every reason ``tp`` cannot split ``cfg``, as one error naming the options."""
    check_splittable(cfg, tp)
    if tp > 1 and cfg.dropout > 0:
        raise TensorParallelError(f"--parallel.tp={tp} needs --model.dropout=0 (now "
                                  f"{cfg.dropout}): dropout over split heads and tokens is "
                                  "not supported")
    if sequence_parallel and cfg.block_size % tp:
        raise TensorParallelError(f"--parallel.sequence_parallel cuts each sequence into "
                                  f"{tp} equal parts: --model.block_size={cfg.block_size} "
                                  f"must be a multiple of --parallel.tp={tp}")


def tensor_parallelize(gpt: GPT, group: TensorParallelGroup, *,
                       sequence_parallel: bool = False) -> GPT:
    """Replace ``gpt``'s layers by this rank's tensor-parallel ones (in place); returns
    it. Nothing changes with a group of one rank."""
    cfg, tp = gpt.cfg, group.size
    if tp == 1:
        return gpt
    check_tensor_parallel(cfg, tp, sequence_parallel)
    sp = sequence_parallel
    for i, block in enumerate(gpt.h):
        attn, mlp = block.attn, block.mlp
        for owner, name, cls in ((attn, "c_attn", ColumnParallelLinear),
                                 (attn, "c_proj", RowParallelLinear),
                                 (mlp, "c_fc", ColumnParallelLinear),
                                 (mlp, "c_proj", RowParallelLinear)):
            prefix = f"h.{i}.{'attn' if owner is attn else 'mlp'}.{name}"
            spec = shard_spec(f"{prefix}.weight", cfg)
            setattr(owner, name, cls.split(getattr(owner, name), spec, group, sp))
        attn.n_head, attn.n_kv_head = cfg.n_head // tp, cfg.n_kv_head // tp
        attn.widths = [w // tp for w in attn.widths]
        if sp:
            for norm in (block.ln_1, block.ln_2):
                _sum_gradients(norm, group)
    gpt.wte = VocabParallelEmbedding.split(gpt.wte, shard_spec("wte.weight", cfg), group)
    if cfg.tie_embeddings:
        gpt.lm_head.weight = gpt.wte.weight
    else:
        gpt.lm_head.weight = split_parameter(gpt.lm_head.weight,
                                             shard_spec("lm_head.weight", cfg), group)
    gpt.lm_head.out_features = cfg.padded_vocab_size // tp
    if sp:
        _sum_gradients(gpt.ln_f, group)
    gpt.tensor_parallel = TensorParallel(group, cfg, sp)
    return gpt


def _sum_gradients(norm: torch.nn.Module, group: TensorParallelGroup) -> None:
    for p in norm.parameters():
        sum_gradient_over_group(p, group)
