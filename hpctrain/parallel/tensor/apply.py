"""``tensor_parallelize(gpt, group)``: turn a whole model into this rank's
tensor-parallel part of it, in place, as its family's plan says (``model/plan.py``).

Every rank built the whole model from the same seed, so each keeps its slice of the very
numbers the single-process model holds (``layout.py``), and the split layers exchange
activations over the group (``layers.py``): the plan's column and row layers in every
block, the token embedding and head by vocabulary (the loss never gathers the logits,
``cross_entropy.py``), and with ``sequence_parallel`` the residual stream cut along the
sequence between them (``mappings.py``). Dropout is refused: the split heads and tokens
would need a random stream per rank that still reproduces the single-process masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctrain.model.common.moe import MoE
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.model.moe_shape import expert_hidden
from hpctrain.model.plan import COLUMN
from hpctrain.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.group import TensorParallelGroup
from hpctrain.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding, split_parameter)
from hpctrain.parallel.tensor.layout import TensorParallelError, check_splittable
from hpctrain.parallel.tensor.mappings import (copy_to_group, gather_from_sequence,
                                               scatter_to_sequence, sum_gradient_over_group)
from hpctrain.parallel.tensor.moe import split_moe


class TensorParallel:
    """The two ends of a tensor-parallel GPT (see ``EmbeddingAndHead.tensor_parallel``)."""

    def __init__(self, group: TensorParallelGroup, cfg: GPTConfig, sequence_parallel: bool):
        self.group, self.cfg, self.sequence_parallel = group, cfg, sequence_parallel
        rows = self.rows = cfg.padded_vocab_size // group.size
        """The columns of this rank's logits (its slice of the padded vocabulary)."""
        self.vocab_start = group.rank * rows
        self.vocab_real = min(max(cfg.vocab_size - self.vocab_start, 0), rows)
        """Rows of this rank's slice that are real tokens (the rest pad the vocabulary)."""

    def enter_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded tokens (B, T, C), whole on every rank -> the blocks' input."""
        return scatter_to_sequence(x, self.group) if self.sequence_parallel else x

    def head_loss(self, model, h: torch.Tensor, targets: torch.Tensor | None):
        """Final norm, this rank's slice of the head, and the loss over the group; without
        targets, the last position's logits over the whole vocabulary (B, 1, V)."""
        h = model.get_submodule(model.plan.final_norm)(h)
        h = (gather_from_sequence(h, self.group) if self.sequence_parallel
             else copy_to_group(h, self.group))
        if targets is None:
            mine = F.linear(h[:, [-1], :], model.head_weight)
            return self.group.all_gather(mine, dim=-1)[..., :self.cfg.vocab_size]
        return vocab_parallel_cross_entropy(h, model.head_weight, targets, self.group,
                                            self.vocab_start, self.vocab_real,
                                            self.cfg.head_chunk(targets.numel(), self.rows))

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
    if cfg.moe_experts and (expert_hidden(cfg) % tp or cfg.bias):
        raise TensorParallelError(f"--parallel.tp={tp} splits each expert's hidden units: "
                                  f"the expert width {expert_hidden(cfg)} "
                                  "(--model.moe_ffn_hidden) must be a multiple of "
                                  f"--parallel.tp={tp}, and --model.bias false")
    if sequence_parallel and cfg.block_size % tp:
        raise TensorParallelError(f"--parallel.sequence_parallel cuts each sequence into "
                                  f"{tp} equal parts: --model.block_size={cfg.block_size} "
                                  f"must be a multiple of --parallel.tp={tp}")


def tensor_parallelize(gpt: GPT, group: TensorParallelGroup, *,
                       sequence_parallel: bool = False) -> GPT:
    """Replace ``gpt``'s layers by this rank's tensor-parallel ones (in place); returns
    it. Nothing changes with a group of one rank."""
    cfg, tp, plan = gpt.cfg, group.size, gpt.plan
    if tp == 1:
        return gpt
    check_tensor_parallel(cfg, tp, sequence_parallel)
    sp = sequence_parallel
    for i, block in enumerate(gpt.get_submodule(plan.blocks)):
        moe = block.get_submodule(plan.moe)
        if isinstance(moe, MoE):  # its experts, not a dense MLP, hold the hidden units
            split_moe(moe, f"{plan.blocks}.{i}.{plan.moe}", cfg, plan, group, sp)
        for split in plan.block_splits:
            if isinstance(moe, MoE) and split.path.startswith(f"{plan.moe}."):
                continue
            owner_path, _, name = split.path.rpartition(".")
            owner = block.get_submodule(owner_path)
            cls = ColumnParallelLinear if split.style == COLUMN else RowParallelLinear
            spec = plan.shard_spec(f"{plan.blocks}.{i}.{split.path}.weight", cfg)
            setattr(owner, name, cls.split(getattr(owner, name), spec, group, sp))
        block.get_submodule(plan.attention).keep_heads(tp)
        if sp:
            for norm in plan.block_norms:
                _sum_gradients(block.get_submodule(norm), group)
    embedding = plan.token_embedding
    setattr(gpt, embedding, VocabParallelEmbedding.split(
        gpt.get_submodule(embedding), plan.shard_spec(f"{embedding}.weight", cfg), group))
    head = gpt.get_submodule(plan.head)
    if cfg.tie_embeddings:
        head.weight = gpt.get_submodule(embedding).weight
    else:
        head.weight = split_parameter(head.weight, plan.shard_spec(f"{plan.head}.weight", cfg),
                                      group)
    head.out_features = cfg.padded_vocab_size // tp
    if sp:
        _sum_gradients(gpt.get_submodule(plan.final_norm), group)
    gpt.tensor_parallel = TensorParallel(group, cfg, sp)
    return gpt


def _sum_gradients(norm: torch.nn.Module, group: TensorParallelGroup) -> None:
    for p in norm.parameters():
        sum_gradient_over_group(p, group)
