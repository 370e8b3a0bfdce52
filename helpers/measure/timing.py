"""Timing GPU-, MPS- and CPU-side work the same way: warm-up runs first, the device synchronized around each
timed run. Compared variants run interleaved (A B A B ...) and are reported as a median with its interquartile
range; two variants whose ranges overlap show no measurable difference, and no ratio is quoted for them."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..system.device import synchronize


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
            elapsed, loss = _timed(step, device)
            seconds[name].append(elapsed)
            losses[name].append(loss)
    return {name: (seconds[name], [float(loss) for loss in losses[name]]) for name in steps}


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one quantity (seconds, or a rate): its median and interquartile range.

    One number hides how noisy a shared machine was; the quartiles say how far to trust a difference.
    """

    samples: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a Spread needs at least one sample")

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """First and third quartile (the samples themselves when there are fewer than two)."""
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    @property
    def relative_iqr(self) -> float:
        """The interquartile range over the median: 0.05 means the middle half of the runs lie within 5%."""
        q1, q3 = self.quartiles
        return (q3 - q1) / abs(self.median) if self.median else math.inf

    def map(self, fn: Callable[[float], float]) -> Spread:
        """The same runs in another unit (seconds -> tokens/s, say)."""
        return Spread(tuple(fn(s) for s in self.samples))

    def overlaps(self, other: Spread) -> bool:
        (a1, a3), (b1, b3) = self.quartiles, other.quartiles
        return a1 <= b3 and b1 <= a3

    def summary(self) -> dict:
        """JSON-ready: median, quartiles and the number of runs."""
        q1, q3 = self.quartiles
        return {"median": self.median, "q1": q1, "q3": q3, "runs": len(self.samples)}

    def __format__(self, fmt: str) -> str:
        q1, q3 = self.quartiles
        return f"{self.median:{fmt}} (IQR {q1:{fmt}}–{q3:{fmt}})"


def ratio(a: Spread, b: Spread) -> float | None:
    """median(a) / median(b), or None when their interquartile ranges overlap: no measurable difference."""
    return None if a.overlaps(b) else a.median / b.median


def verdict(name_a: str, a: Spread, name_b: str, b: Spread, higher_is_better: bool = True) -> str:
    """One line comparing two measured quantities, quoting a ratio only when it holds beyond the noise."""
    r = ratio(a, b)
    if r is None:
        return f"{name_a} vs {name_b}: no measurable difference (their IQRs overlap)"
    better = (r > 1) == higher_is_better
    return f"{name_a} is {max(r, 1 / r):.2f}x {'better' if better else 'worse'} than {name_b} (IQRs apart)"


def interleaved(steps: dict[str, Callable[[], object]], device: torch.device, rounds: int = 7,
                warmup: int = 1, min_sample_s: float = 0.01) -> dict[str, Spread]:
    """Seconds per call of each step, measured A B C A B C ... so a busy moment of a shared machine falls on all
    of them alike. Each sample repeats a step enough times to last `min_sample_s` (timer resolution)."""
    if rounds < 1:
        raise ValueError(f"rounds must be 1 or more, got {rounds}")
    repeats = {}
    for name, step in steps.items():
        for _ in range(warmup):  # allocations, kernel choice, compilation
            step()
        repeats[name] = max(1, math.ceil(min_sample_s / max(_timed(step, device)[0], 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            samples[name].append(_timed(step, device, repeats[name])[0])
    return {name: Spread(tuple(s)) for name, s in samples.items()}


def _timed(step: Callable[[], object], device: torch.device, number: int = 1) -> tuple[float, object]:
    """Seconds per call of `number` calls, the device synchronized around them, and the last call's result."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        out = step()
    synchronize(device)
    return (time.perf_counter() - start) / number, out
