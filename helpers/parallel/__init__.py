"""Parallel training with torchrun: launching, process groups, communication accounting,
tensor, pipeline and expert parallelism."""
