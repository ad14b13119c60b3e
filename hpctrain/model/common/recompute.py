"""Selective activation recomputation: which of a block's results backward keeps.

A block run under ``selective_checkpoint`` keeps the outputs of its matrix multiplies
and of fused attention (their inputs' gradients need the expensive work) and recomputes,
from those, the element-wise work between them in backward: norms, activations, rotary,
residual adds, dropout (its masks drawn again from the RNG state ``checkpoint`` saved).
This is Korthikanti et al. 2022's "selective" idea turned around: fused attention
already keeps no softmax, so what is left to drop is the element-wise layers' outputs
(docs/design/compute-options.md derives both sizes).
"""

from __future__ import annotations

import collections
import functools

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default}
                    | ({_aten._grouped_mm.default} if hasattr(_aten, "_grouped_mm") else set()))
"""A linear layer's product (``F.linear`` flattens (B, T, C) to these) and the routed
experts' grouped one. Batched products (``bmm``) are left out: in unfused attention
they make the (T, T) scores."""

FUSED_ATTENTION = frozenset(
    getattr(_aten, name).default for name in (
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(_aten, name))
"""The fused attention kernels: their outputs (and log-sum-exp) are what their backward
reads; the (T, T) scores are never kept."""


def _policy(keep_attention: bool, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in MATMULS or (keep_attention and op in FUSED_ATTENTION):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class _KeptForEveryBackward(dict):
    """One operator's kept outputs by call index. torch's cache marks an output used
    once it has served a recomputation and refuses a second; a zero-bubble pipeline's B
    and W passes (``parallel/pipeline/split_backward.py``) each recompute the block, so
    here the mark is ignored and the outputs live as long as the block's graph."""

    def __setitem__(self, index, value):
        if value is not _torch_checkpoint._CONSUMED:
            super().__setitem__(index, value)


def _contexts(keep_attention: bool):
    policy = functools.partial(_policy, keep_attention)
    if torch.compiler.is_compiling():  # the compiler reads torch's own pair
        return create_selective_checkpoint_contexts(policy)
    kept = collections.defaultdict(_KeptForEveryBackward)
    return (_torch_checkpoint._CachingTorchDispatchMode(policy, kept),
            _torch_checkpoint._CachedTorchDispatchMode(policy, kept))


def selective_checkpoint(fn, x: torch.Tensor, keep_attention: bool) -> torch.Tensor:
    """``fn(x)``, keeping the matmul (and, with ``keep_attention``, fused attention)
    outputs for backward and recomputing the rest there. ``keep_attention=False`` where
    attention draws dropout: a kept result would not advance the RNG in the recomputed
    forward, and every later mask would differ; attention is then recomputed too."""
    return checkpoint(fn, x, use_reentrant=False,
                      context_fn=functools.partial(_contexts, keep_attention))


class KeptActivations(TorchDispatchMode):
    """Measures what a forward leaves alive for backward: run the forward inside
    ``with KeptActivations() as kept:`` and read ``kept.bytes(exclude)`` while its
    outputs are still referenced. Counts each storage an operator made once (a view and
    its base are one), alive or not by its weak reference, so it sees what autograd's
    saved tensors hold and what a selective checkpoint caches beside them alike.
    ``exclude``: tensors whose storages are not activations (parameters, inputs)."""

    def __init__(self):
        super().__init__()
        self._made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                known = self._made.get(storage.data_ptr())
                if known is None or known[0].expired():  # an address freed and reused
                    self._made[storage.data_ptr()] = (StorageWeakRef(storage),
                                                      storage.nbytes())
        return out

    def bytes(self, exclude=()) -> int:
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum(n for ptr, (ref, n) in self._made.items()
                   if ptr not in skip and not ref.expired())
