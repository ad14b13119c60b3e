"""The training loop, optimizer and schedule, metrics."""
