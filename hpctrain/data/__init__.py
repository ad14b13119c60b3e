"""Token data: tokenizers (tokenizers.py), the HDF5 format and manifests (format.py),
parallel preparation (prepare.py; the default corpus: corpus.py; the validation split:
split.py), metadata and checks (dataset.py), MPI-IO readers (mpiio.py; ROMIO hints:
hints.py), the prefetching reader thread (prefetch.py), the node-local copy (local_copy.py),
opening it all for training (loader.py), and the step sampler (sampler.py)."""
