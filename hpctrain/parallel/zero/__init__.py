"""ZeRO data parallelism (levels 0-3, fp32 or bf16) in four modules:

- ``buckets.py``: the storage: flat buckets of parameters, their shards of fp32 master
  weights, gradients and Adam moments, and the fp32 staging buffers of levels 2-3;
- ``engine.py``: ``Zero``, the gradient engine: reductions in bucket order, the sharded
  optimizer step and memory figures;
- ``gather.py``: ZeRO-3's parameter gathers around each block's forward and backward;
- ``state.py``: what the engine gives a checkpoint and takes back from one.
"""

from hpctrain.parallel.zero.engine import Zero

__all__ = ["Zero"]
