"""``hpctrain doctor``: an acceptance check of one node, run before training on it.

    mpiexec -n 4 hpctrain doctor --json doctor.json

Each rank reports its device and CPU affinity; then the MPI library and its thread level,
whether it is GPU-aware per vendor and why (``comm/gpu_aware.py``), allreduce of host and
device buffers (checked and timed at 1, 25 and 150 MiB), a bf16 round trip between rank
pairs (the pipeline's point-to-point path, on the device when there is one) and one GPT
training step (tokens/s and MFU where the device's peak is known). Rank 0 prints the
report and writes it as JSON; the exit status is 1 when any check failed, naming it.

Every verdict is agreed by all ranks (a check fails when it fails on any rank), and every
wait has a deadline (``watchdog.wait_all``), so a broken node ends the job with a message
instead of hanging it. ``HPCTRAIN_DOCTOR_FAULT=allreduce|p2p|train`` plants a fault in
that check (for the tests that prove a failure is reported).

- ``comm_checks.py``: each rank's device and CPU affinity, the MPI library, GPU-aware MPI,
  allreduce and the bf16 round trip: the communication layer alone;
- ``train_step.py``: one training step with the trainer's pieces (``parallelize``);
- ``report.py``: the sections, the failures and the printed report;
- ``run.py``: ``run_doctor``, every check in order.
"""
