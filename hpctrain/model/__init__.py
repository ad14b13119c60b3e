"""The models: one skeleton (``gpt.py``) and the families that fill it (``gpt2/``,
``llama/``), each with its parallel plan (``plan.py``). Knows nothing about MPI;
docs/design/models.md.
"""
