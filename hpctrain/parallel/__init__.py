"""Parallelisms that wrap the model: data parallelism (bucketed allreduce) for now."""
