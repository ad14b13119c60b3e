"""Context parallelism: one sequence's tokens split over a group of ranks, attention
computed by ring attention.

- ``chunks.py``: which tokens each rank holds (causal load balancing; pure, no MPI);
- ``blocks.py``: one block of attention, the log-sum-exp merge, its backward (pure);
- ``ring.py``: the group's ring of non-blocking neighbour transfers, with deadlines;
- ``ring_attention.py``: ``ring_attention``, the autograd function over the ring;
- ``apply.py``: ``context_parallelize``, ring attention and global positions on a model.

docs/design/context-parallel.md has the ring, the merge formulas, training with it
and what is not supported.
"""
