"""``hpctrain doctor``: an acceptance check of one node, run before training on it.

    mpiexec -n 4 hpctrain doctor --json doctor.json

Each rank reports its device and CPU affinity; then come the MPI library and GPU-aware
MPI, the node's set-up mistakes, allreduces through MPI and the device's collective
library, a bf16 round trip between rank pairs, and compiled GPT training steps. Every
verdict is agreed by all ranks and every wait has a deadline; rank 0 prints the result
and writes it as JSON, and the exit status is 1 when any check failed, naming it.
The checks, the floors and the files of this package: docs/design/devices.md.
"""
