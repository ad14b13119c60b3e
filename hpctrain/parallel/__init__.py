"""Parallelisms that wrap the model, behind two interfaces: ``engine.py`` (``GradEngine``:
gradients -> optimizer step) and ``runner.py`` (``Runner``: a step's micro-batches on this
rank; ``LocalRunner`` for a model whole on the rank). ``parallelize(gpt, grid, cfg)``
applies them in one fixed order: ``tensor/`` (tp, and sequence parallelism) first, then
the ``pipeline/`` cut (schedules as data, stages, executor), then the gradient engine
that ``choose_engine.py`` picks (``data_parallel.py``, ``mixed_precision.py``, ``zero/``).
Next: ``context/`` (cp, ring attention) and ``experts/`` (ep, MoE all-to-all; ep drawn
from dp x cp). The grid,
outermost first: dp x pp x cp x tp. The whole step, with these in their places:
docs/design/training-step.md.
"""
