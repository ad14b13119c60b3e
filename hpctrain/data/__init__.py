"""Token data: tokenizers, the HDF5 format and manifests (format.py), parallel preparation
(prepare.py), metadata and checks (dataset.py), MPI-IO readers (mpiio.py), the prefetching
reader thread (prefetch.py), node-local staging (stage.py), opening it all for training
(loader.py), and the step sampler (sampler.py)."""
