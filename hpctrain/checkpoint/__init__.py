"""Checkpoints: the single-file final checkpoint (``final.h5``)."""
