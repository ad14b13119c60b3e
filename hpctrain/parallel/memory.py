"""Per-rank memory of model state, for the trainer's log and the ZeRO benchmark."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hpctrain.sizes import MiB

STAGED_AT_ONCE = 3
"""The staging pool's default budget in buckets (of the largest staged one): one bucket
filling, one reducing, and ZeRO-3's embeddings unit, which fills from backward's first
gradient (the final norm's) to its last (the tied embedding's)."""


def tensor_bytes(t) -> int:
    """Bytes a tensor's storage holds (0 for None or a freed ZeRO-3 buffer)."""
    if t is None:
        return 0
    return t.untyped_storage().nbytes() if t.numel() else 0


@dataclass(frozen=True)
class MemoryReport:
    params: int
    """Parameters in the compute dtype (full, or this rank's shard for ZeRO-3)."""
    grads: int
    optimizer: int
    """Adam moments plus fp32 master weights where they are a separate copy."""
    comm_buffers: int
    """Reduction staging and (peak) gathered ZeRO-3 parameters."""

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    def per_param(self, n_params: int) -> float:
        """Model-state bytes per parameter, comparable to the ZeRO paper's formulas."""
        return self.model_state / n_params

    def to_dict(self) -> dict:
        return {**asdict(self), "model_state": self.model_state}

    def describe(self) -> str:
        return (f"params {self.params / MiB:.1f} MiB, grads {self.grads / MiB:.1f} MiB, "
                f"optimizer {self.optimizer / MiB:.1f} MiB, comm buffers "
                f"{self.comm_buffers / MiB:.1f} MiB per rank")


def zero_formula(level: int, dtype: str, world: int) -> float:
    """Model-state bytes per parameter of ``Zero``: the ZeRO paper's (Rajbhandari et al.
    2020) Adam with fp32 master weights and moments (K = 12), except that bf16 keeps fp32
    gradients (4 bytes, not the paper's 2), as Megatron does, so micro-batches accumulate
    and reduce in fp32 and the optimizer reads unrounded sums."""
    n = world
    if dtype == "fp32":  # params 4, grads 4, moments 8 (params are the master)
        return {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[level]
    # params 2, fp32 grads 4, fp32 master 4 + moments 8
    return {0: 18, 1: 6 + 12 / n, 2: 2 + 16 / n, 3: 18 / n}[level]
