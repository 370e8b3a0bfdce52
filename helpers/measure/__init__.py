"""Measuring: timing, memory, FLOPs and MFU, the batch-size finder, and the bench-* harnesses."""
