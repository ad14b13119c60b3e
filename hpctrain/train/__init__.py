"""The training loop (``trainer.py``) and what it composes: the learning-rate schedule,
evaluation, metrics and MFU, periodic checkpoints and the final outputs, the run
directory, stopping on a signal or before the walltime, non-finite steps, step timing."""
