"""Parallel training with torchrun: launching, process groups, communication accounting,
tensor and pipeline parallelism."""
