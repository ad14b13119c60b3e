"""ZeRO data parallelism (stages 0-3, fp32 or bf16) in three modules:

- ``buckets.py``: the storage: flat buckets of parameters, their shards of fp32 master
  weights, gradients and Adam moments, and the fp32 staging buffers of stages 2-3;
- ``engine.py``: ``Zero``, the gradient engine: reductions in bucket order, the sharded
  optimizer step, checkpoint state and memory figures;
- ``gather.py``: ZeRO-3's parameter gathers around each block's forward and backward.
"""

from hpctrain.parallel.zero.engine import Zero

__all__ = ["Zero"]
