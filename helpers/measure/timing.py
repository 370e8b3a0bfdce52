"""Timing GPU-, MPS- and CPU-side work the same way: warm-up runs first, the device synchronized around each
timed run; torch.utils.benchmark's median for one step, interleaved rounds to compare several."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..system.device import synchronize


def median_seconds(step: Callable[[], object], device: torch.device, min_run_time: float) -> float:
    """Median seconds of `step()` after a warm-up run, by torch.utils.benchmark (which synchronizes CUDA itself;
    Apple's MPS is synchronized here)."""
    run = step
    if device.type == "mps":
        def run():
            step()
            synchronize(device)
    # Imported here: torch.utils.benchmark loads the C++ extension machinery, which on a CUDA build of torch
    # without a GPU logs a warning; importing this module (as every --help of the command line does) stays quiet.
    from torch.utils import benchmark

    run()  # warm-up: allocations, optimizer state, kernel selection, compilation
    timer = benchmark.Timer("run()", globals={"run": run}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


def warm_up(step: Callable[[], float], n: int) -> list[float]:
    """Run `n` untimed steps (allocation, kernel choice, compilation); their losses."""
    return [float(step()) for _ in range(n)]


def timed_rounds(steps: dict[str, Callable[[], float]], repeats: int,
                 device: torch.device) -> dict[str, tuple[list[float], list[float]]]:
    """(seconds, losses) of `repeats` timed runs of each step.

    With several steps, each round runs every one of them once, interleaved, so a busy moment of a shared
    machine falls on all of them alike; the ratio of their medians is what to compare.
    """
    seconds = {name: [] for name in steps}
    losses = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            losses[name].append(step())
            synchronize(device)
            seconds[name].append(time.perf_counter() - start)
    return {name: (seconds[name], [float(loss) for loss in losses[name]]) for name in steps}
