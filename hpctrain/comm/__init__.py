"""MPI runtime: the world of ranks and their devices, the process grid, tensors as MPI
buffers, the shared-memory gradient allreduce, small collectives with deadlines, and the
job's abort; also the launcher checks (``world_check.py``) and this machine's mpiexec for
tests and tools (``local_mpiexec.py``).

Nothing here imports ``torch.nn``. Importing a module of hpctrain never initializes MPI:
modules reach mpi4py through ``comm/mpi.py``, which imports ``mpi4py.MPI`` (and so starts
MPI) at the first use, in practice ``World.create``.
"""
