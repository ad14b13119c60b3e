"""Which token windows each step trains on.

The global batch of step ``s`` is a pure function of ``(seed, s)``, never of the number
of ranks, so every run sees the same samples in the same order and a resumed run picks
up at any step without replaying anything; each rank takes its contiguous share. Two
orders: ``epoch`` (default, as Megatron-LM's GPT dataset: every token once per epoch)
and ``random`` (nanoGPT's ``get_batch``). ``docs/design/data-path.md`` ("Which windows a
step reads: the sampler").
"""

from __future__ import annotations

import numpy as np

TRAIN_STREAM, EVAL_STREAM = 0, 1
SAMPLERS = ("epoch", "random")


def shard_range(n: int, index: int, count: int) -> tuple[int, int]:
    """Contiguous part ``index`` of ``count`` equal parts of ``range(n)``."""
    if n % count:
        raise ValueError(f"{n} items cannot be split evenly into {count} parts")
    per = n // count
    return index * per, (index + 1) * per


class _Sampler:
    def __init__(self, n_tokens: int, block_size: int, batch_size: int, seed: int,
                 stream: int = TRAIN_STREAM):
        if n_tokens < block_size + 1:
            raise ValueError(f"{n_tokens} tokens are too few for windows of {block_size + 1}")
        self.n_tokens, self.block = n_tokens, block_size
        self.batch_size, self.seed, self.stream = batch_size, seed, stream

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([self.seed, self.stream, *key]))

    def global_starts(self, step: int) -> np.ndarray:
        raise NotImplementedError

    def local_starts(self, step: int, index: int, count: int) -> np.ndarray:
        lo, hi = shard_range(self.batch_size, index, count)
        return self.global_starts(step)[lo:hi]


class RandomWindowSampler(_Sampler):
    """Uniform random starts in ``[0, n_tokens - block_size - 1]``, seeded per step."""

    def global_starts(self, step: int) -> np.ndarray:
        high = self.n_tokens - self.block  # a window needs block_size + 1 tokens
        return self._rng(step).integers(0, high, size=self.batch_size, dtype=np.int64)


class EpochSampler(_Sampler):
    """Shuffled non-overlapping windows, a new phase and permutation every epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # With any phase in [0, block), this many windows of block + 1 tokens still fit.
        self.per_epoch = max(1, (self.n_tokens - self.block) // self.block)
        self._epoch, self._order = -1, None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # cache one epoch: consecutive steps share it
            rng = self._rng(epoch)
            phase = int(rng.integers(0, self.block))
            self._order = phase + rng.permutation(self.per_epoch).astype(np.int64) * self.block
            self._epoch = epoch
        return self._order

    def global_starts(self, step: int) -> np.ndarray:
        first = step * self.batch_size
        samples = np.arange(first, first + self.batch_size, dtype=np.int64)
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(samples // self.per_epoch):
            mask = samples // self.per_epoch == epoch
            out[mask] = self._epoch_order(int(epoch))[samples[mask] % self.per_epoch]
        return out


def make_sampler(kind: str, n_tokens: int, block_size: int, batch_size: int, seed: int,
                 stream: int = TRAIN_STREAM) -> _Sampler:
    if kind == "epoch":
        return EpochSampler(n_tokens, block_size, batch_size, seed, stream)
    if kind == "random":
        return RandomWindowSampler(n_tokens, block_size, batch_size, seed, stream)
    raise ValueError(f"unknown sampler {kind!r}; choose one of {', '.join(SAMPLERS)}")


def all_windows(n_tokens: int, block_size: int) -> np.ndarray:
    """Starts of the non-overlapping windows that cover a split (the final full eval)."""
    return np.arange(0, n_tokens - block_size, block_size, dtype=np.int64)
