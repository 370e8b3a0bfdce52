"""Timing GPU-, MPS- and CPU-side work the same way: warm up once, then torch.utils.benchmark's median."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import benchmark


def median_seconds(step: Callable[[], object], device: torch.device, min_run_time: float) -> float:
    """Median seconds of `step()` after a warm-up run, by torch.utils.benchmark (which synchronizes CUDA itself;
    Apple's MPS is synchronized here)."""
    run = step
    if device.type == "mps":
        def run():
            step()
            torch.mps.synchronize()
    run()  # warm-up: allocations, optimizer state, kernel selection, compilation
    timer = benchmark.Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median
