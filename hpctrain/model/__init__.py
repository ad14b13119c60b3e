"""The GPT model. Knows nothing about MPI."""
