"""Tensor parallelism (Megatron-LM style) and sequence parallelism: every layer's weights
and activations split over a group of adjacent ranks.

- ``layout.py``: which parameters are split, along which dimension (pure; no MPI);
- ``group.py``: the group's blocking collectives (MPI or the device library);
- ``mappings.py``: the autograd functions where activations cross the group;
- ``layers.py``: column- and row-parallel linears, the vocabulary-parallel embedding;
- ``cross_entropy.py``: the loss over a split vocabulary;
- ``apply.py``: ``tensor_parallelize``, which turns a built GPT into this rank's part.

docs/design/tensor-parallel.md has the collectives of every layer in a table.
"""
