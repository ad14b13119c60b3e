"""Tokenizers, corpus preparation (text -> HDF5), the step sampler and the token reader."""
