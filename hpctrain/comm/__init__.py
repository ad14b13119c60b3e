"""MPI runtime: the world of ranks and their devices, the process grid, tensors as MPI
buffers, the shared-memory gradient allreduce, small collectives with deadlines, and the
job's abort; also the launcher checks (``world_check.py``) and this machine's mpiexec for
tests and tools (``local_mpiexec.py``).

Nothing here imports ``torch.nn``; importing this package does not initialize MPI
(``hpctrain.comm.world`` does, through ``mpi4py.MPI``).
"""
