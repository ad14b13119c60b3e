"""hpctrain: MPI-native GPT training for HPC systems.

Launch with ``mpiexec -n N hpctrain train RECIPE [--section.key=value ...]``.
The loss trajectory is the same for any N (to fp32 round-off): parallelism is a
pure performance transformation.
"""

__version__ = "0.1.0"
