"""Parallelisms that wrap the model, behind the interfaces of ``engine.py`` (``GradEngine``:
gradients -> optimizer step; ``Runner``: a step's micro-batches on this rank).

- ``parallelize.py``: ``parallelize(gpt, grid, cfg)`` applies the wrappers in one order;
- ``choose_engine.py``: the one rule that picks the gradient engine, and building it;
- ``data_parallel.py``: replicated fp32 data parallelism with a bucketed allreduce
  (``bucketing.py``: bucket plan and launch order); ``mixed_precision.py``: the same in
  bf16, as the ZeRO engine's level 0;
- ``zero/``: ZeRO levels 1-3 (``shards.py``: where each rank's shard lies);
- ``pipeline/``: pipeline schedules as data, GPT stages and the MPI executor;
- ``runner.py``: ``LocalRunner``, the runner of a model that is whole on every rank;
- ``optim.py``: AdamW groups and clipping; ``memory.py``: bytes of model state per rank.
"""
