"""Pipeline parallelism: pure schedules, GPT stages, and an MPI executor."""
