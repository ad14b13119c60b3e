"""MPI runtime: the world of ranks, tensor buffers for MPI, deadlines and job abort.

Nothing here imports ``torch.nn``; importing this package does not initialize MPI
(``hpctrain.comm.world`` does, through ``mpi4py.MPI``).
"""
