"""Which tokens of which input files ``prepare`` puts in the validation split.

The tail of a corpus read in sorted order is not a sample of it, so the validation split
is drawn from the whole corpus, by file: whole files in a seeded random order (a BLAKE2b
hash any language can reproduce) until the target, the last one giving its last tokens.
The split sizes are exactly a tail split's, a single file gets nanoGPT's tail split, and
the choice never depends on the number of ranks. ``docs/design/data-path.md`` ("Which
tokens go to validation"); the user-facing rule is in ``io/FORMAT.md``.
"""

from __future__ import annotations

import hashlib

SPLIT_RULE = "shuffled-files"
SPLIT_SEED = 0  # fixed: the same inputs always give the same split


def shuffled_order(n_files: int, seed: int = SPLIT_SEED) -> list[int]:
    """File indices in the seeded random order of step 1."""
    def key(i: int) -> bytes:
        return hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest()
    return sorted(range(n_files), key=key)


def val_tokens_per_file(counts: list[int], n_val: int, seed: int = SPLIT_SEED) -> list[int]:
    """How many of each file's last tokens go to validation (``counts`` = tokens per file,
    in input order; the values sum to ``n_val``)."""
    if not 0 <= n_val <= sum(counts):
        raise ValueError(f"n_val={n_val} is not between 0 and the {sum(counts)} tokens")
    val, need = [0] * len(counts), n_val
    for i in shuffled_order(len(counts), seed):
        if need == 0:
            break
        val[i] = min(counts[i], need)
        need -= val[i]
    return val
