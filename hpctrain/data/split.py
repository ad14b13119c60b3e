"""Which tokens of which input files ``prepare`` puts in the validation split.

The last ``val_fraction`` of a corpus read in sorted order is not a sample of it: for the
default corpus (the standard library's sources, sorted by path) it is almost all
``encodings/cp*.py`` codec tables, whose loss says little about the rest (io/FORMAT.md,
"How prepare splits train and validation"). So the validation split is drawn from the
whole corpus, by file:

1. the files are put in a seeded random order: by the BLAKE2b hash of ``"<seed>:<index>"``
   (index = the file's place in the input list), which any language can reproduce and no
   library upgrade changes (unlike a numpy or ``random`` shuffle);
2. in that order, whole files go to validation until the next file would pass the target
   (``n_tokens - int(n_tokens * (1 - val_fraction))``, the size of a tail split); that
   file gives its *last* tokens to make up the difference, its head stays in training.

Every file but at most one lies wholly in one split, and the split sizes are exactly a
tail split's. A single file is the special case "its last tokens", i.e. nanoGPT's tail
split. The choice depends only on the per-file token counts, never on how many ranks
tokenized them. Inside each split the files keep their input order, so a rank's contiguous
run of files is one contiguous piece of each split (see ``prepare.py``).
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
