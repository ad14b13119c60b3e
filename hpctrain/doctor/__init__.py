"""``hpctrain doctor``: an acceptance check of one node, run before training on it.

    mpiexec -n 4 hpctrain doctor --json doctor.json

Each rank reports its device and CPU affinity; then the MPI library and its thread level,
whether it is GPU-aware per vendor and why (``comm/gpu_aware.py``), the node's set-up
(ranks sharing a GPU, cores on another NUMA node than the GPU, MPI not GPU-aware where
the system's file turns GPU support on, pip's MPICH on a site with its own MPI, a
CPU-only torch on a GPU node), allreduce of host and device buffers through MPI and the
device's collective library (checked and timed at 1, 25 and 150 MiB), a bf16 round trip
between rank pairs (the pipeline's point-to-point path, on the device when there is one)
and compiled GPT training steps (tokens/s and MFU where the device's peak is known); on a
GPU, bandwidths and MFU below a healthy node's floors fail. Rank 0 prints the result and
writes it as JSON; the exit status is 1 when any check failed, naming it.

Every verdict is agreed by all ranks (a check fails when it fails on any rank), and every
wait has a deadline (``watchdog.wait_all``), so a broken node ends the job with a message
instead of hanging it. ``HPCTRAIN_DOCTOR_FAULT=allreduce|p2p|train`` plants a fault in
that check (for the tests that prove a failure is reported).

- ``comm_checks.py``: each rank's device and CPU affinity, the MPI library, GPU-aware MPI,
  allreduce and the bf16 round trip: the communication layer alone;
- ``setup_checks.py``: the set-up mistakes, each a small function of facts;
- ``train_step.py``: training steps with the trainer's pieces (``parallelize``);
- ``thresholds.py``: the floors of a healthy GPU node, and the verdicts;
- ``node_check.py``: the node check's result: the sections, the failures, the printed text;
- ``run.py``: ``run_doctor``, every check in order.
"""
