"""One parallel arrangement of a training run as the performance model sees it (ranks,
dp x pp x cp x tp, expert parallelism drawn from dp x cp, ZeRO level, micro-batches,
schedule, recomputation, dtype), and the checks that refuse one the trainer would refuse
(``Arrangement.check``)."""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import UserError
from hpctrain.model.shape import WHOLE_HEAD
from hpctrain.parallel.tensor.layout import check_splittable
from hpctrain.scaling.models import ModelShape

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv")
RECOMPUTE = ("none", "selective", "block")


@dataclass(frozen=True)
class Arrangement:
    """One parallel configuration of a training step, with the two model options that
    change its memory and compute but not its result (recompute, loss_chunk)."""

    ranks: int
    pp: int = 1
    zero: int = 0
    micro_batches: int = 1
    global_batch: int = 1
    """Sequences per optimizer step over all ranks."""
    dtype: str = "fp32"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    bucket_mb: float = 25.0
    recompute: str = "none"
    """'block': each block keeps only its input and runs again in backward; 'selective':
    each keeps its matmul and attention outputs (``--model.recompute``)."""
    recompute_every: int = 0
    """Every N-th block recomputed wholly, the others as ``recompute`` says
    (``--model.recompute_every``); 0: none so."""
    loss_chunk: int = 0
    """Tokens per chunk of the head and loss (``--model.loss_chunk``); 0: automatic
    (``GPTConfig.head_chunk``), -1: all at once."""
    tp: int = 1
    """Tensor-parallel ranks (``--parallel.tp``): adjacent ranks, inside a node."""
    sequence_parallel: bool = False
    """``--parallel.sequence_parallel``: norms and residual stream cut along the sequence."""
    cp: int = 1
    """Context-parallel ranks (``--parallel.cp``): each holds 2 chunks of every sequence
    and attention runs as a ring (``context_cost.py``); ranks = dp x pp x cp x tp."""
    ep: int = 1
    """Expert-parallel ranks: each of ``ep`` ranks of the dp x cp group holds 1/ep of every
    MoE block's routed experts and tokens travel to them by all-to-all
    (``expert_cost.py``); ep divides dp x cp and the expert count."""

    @property
    def dp(self) -> int:
        return self.ranks // (self.pp * self.tp * self.cp)

    @property
    def grad_group(self) -> int:
        """Ranks holding the same weights, over which gradients are reduced: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_group(self) -> int:
        """Ranks holding the same experts, over which expert gradients are reduced:
        dp x cp / ep."""
        return self.grad_group // self.ep

    @property
    def micro_rows(self) -> int:
        return self.global_batch // (self.dp * self.micro_batches)

    def check(self, shape: ModelShape) -> None:
        """Raise ``UserError`` naming the fix for an arrangement the trainer would refuse."""
        if self.tp < 1 or self.ranks % self.tp:
            raise UserError(f"{self.ranks} rank(s) do not split into tensor-parallel groups "
                            f"of tp={self.tp}; use a tp that divides the rank count")
        if self.cp < 1 or (self.ranks // self.tp) % self.cp:
            raise UserError(f"{self.ranks} rank(s) do not split into context-parallel groups "
                            f"of cp={self.cp} (x tp={self.tp}); use a cp that divides the rank "
                            "count over tp")
        if self.cp > 1 and shape.block_size % (2 * self.cp):
            raise UserError(f"context {shape.block_size} does not split into 2 x cp={self.cp} "
                            f"chunks; use a cp with 2 cp dividing the sequence length")
        if self.ranks < 1 or self.pp < 1 or (self.ranks // (self.tp * self.cp)) % self.pp:
            raise UserError(f"{self.ranks} rank(s) do not split into pp={self.pp} stages"
                            + (f" of tp={self.tp} ranks" if self.tp > 1 else "")
                            + "; use a pp that divides the rank count")
        self._check_experts(shape)
        if self.sequence_parallel and self.tp == 1:
            raise UserError("sequence parallelism splits the sequence over the "
                            "tensor-parallel ranks: it needs tp > 1")
        check_splittable(shape.gpt, self.tp)
        if self.pp > shape.n_layer * self.virtual_stages:
            raise UserError(f"pp={self.pp} is more stages than the {shape.n_layer} layers")
        if self.schedule == "zbv" and self.pp > 1 and (
                self.micro_batches < 2 * self.pp or shape.n_layer < 2 * self.pp):
            raise UserError(f"zbv at pp={self.pp} needs at least {2 * self.pp} micro-batches "
                            f"and layers (two chunks per stage); use more, or zb-h1")
        if self.zero not in (0, 1, 2, 3):
            raise UserError(f"zero={self.zero}: use 0, 1, 2 or 3")
        if self.pp > 1 and self.zero > 1:  # the trainer's rule (parallel/pipeline)
            raise UserError(f"pp={self.pp} combines with ZeRO stage 0 or 1, not {self.zero}: "
                            "stages 2-3 shard gradients per micro-batch")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if self.dtype not in ("fp32", "bf16"):
            raise UserError(f"dtype {self.dtype!r}: use fp32 or bf16")
        if self.recompute not in RECOMPUTE:
            raise UserError(f"recompute {self.recompute!r}: use one of {', '.join(RECOMPUTE)}")
        if self.recompute_every < 0 or (self.recompute_every and self.recompute == "block"):
            raise UserError(f"recompute_every={self.recompute_every}: use 0, or N >= 1 with "
                            "recompute none or selective (block recomputes every block)")
        if self.loss_chunk < WHOLE_HEAD:
            raise UserError(f"loss_chunk {self.loss_chunk}: use 0 (automatic), -1 (the whole "
                            "head at once) or a positive number of tokens")
        per = self.dp * self.micro_batches
        if self.global_batch < per or self.global_batch % per:
            raise UserError(f"global batch {self.global_batch} does not split into dp={self.dp}"
                            f" x micro_batches={self.micro_batches}; use a multiple of {per}")

    def _check_experts(self, shape: ModelShape) -> None:
        if shape.moe_experts and self.cp > 1:  # as the trainer (config/checks.py)
            raise UserError(f"cp={self.cp} with a mixture of experts: context parallelism "
                            "and experts are not combined yet; use cp=1")
        if self.ep == 1:
            return
        if self.ep > 1 and not shape.moe_experts:
            raise UserError(f"ep={self.ep} spreads experts over ranks, and {shape.label} has "
                            "none; use ep=1 (or a model with moe_experts)")
        if self.tp > 1:  # as the trainer: parallel/experts/apply.py
            raise UserError(f"ep={self.ep} with tp={self.tp}: expert and tensor parallelism "
                            "are not combined yet; use tp=1 with ep > 1, or ep=1")
        group = self.grad_group
        if self.ep < 1 or group % self.ep or shape.moe_experts % self.ep:
            raise UserError(f"ep={self.ep} must divide both dp x cp = {group} and the "
                            f"{shape.moe_experts} experts; use a common divisor of the two")
