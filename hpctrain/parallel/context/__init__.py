"""Context parallelism: one sequence's tokens split over a group of ranks, attention
computed by ring attention.

- ``chunks.py``: which tokens each rank holds (causal load balancing; pure, no MPI);
- ``blocks.py``: one block of attention, the log-sum-exp merge, its backward (pure);
- ``ring.py``: the group's ring of non-blocking neighbour transfers, with deadlines;
- ``ring_attention.py``: ``ring_attention``, the autograd function over the ring.

docs/design/context-parallel.md has the ring, the merge formulas and what is not done yet.
"""
