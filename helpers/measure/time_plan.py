"""Time of a notebook's gpu-scale work on a free Colab T4, by estimate: no T4 ran these notebooks for the course, so
each heavy notebook's work is added up cell by cell (its inputs: `helpers.manifest`) at the rates stated here.

Rates assumed for a T4 (stated, not measured). Matmuls sustain ~30% of its 65 TFLOP/s fp16 tensor-core peak and ~60%
of its 8.1 TFLOP/s fp32 peak; memory ~70% of its 320 GB/s. At a small batch a pass is bound by launching its kernels
instead: eager PyTorch launches ~15 per transformer block, ~20 us each with the Python around them: ~0.3 ms per
block, ~0.2 ms for the embedding, the head and the sampling (a decode step of a 12-layer model: ~4 ms). A pass takes
the longest of the three; a training step is three passes' launches (forward, backward, optimizer) and 6 FLOPs per
parameter and token. Host work (tokenizers, float64 checks, files) is a stated allowance per notebook.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import GPTConfig
from .memory_plan import parameter_count

T4_SUSTAINED = {torch.float16: 20e12, None: 5e12}  # FLOP/s of matmuls, by autocast dtype (None: fp32)
T4_BANDWIDTH = 220e9  # bytes/s
LAUNCH_S_PER_BLOCK, LAUNCH_S_PER_CALL = 0.3e-3, 0.2e-3
NOTEBOOK_MINUTES = 8  # the budget of a whole notebook at its gpu scale on a free Colab T4
TRAINING_MINUTES = 10  # the budget of the training alone, in a notebook that is its training runs


@dataclass(frozen=True)
class TimeEstimate:
    """A notebook's estimated seconds on a T4, by part, and the minutes it is allowed."""

    seconds: dict[str, float]
    budget_minutes: float

    @property
    def fits(self) -> bool:
        return sum(self.seconds.values()) <= 60 * self.budget_minutes

    def __str__(self) -> str:
        parts = ", ".join(f"{part}: {seconds:.0f} s" for part, seconds in self.seconds.items())
        return f"{sum(self.seconds.values()) / 60:.1f} min of {self.budget_minutes} ({parts})"


def pass_seconds(config: GPTConfig, tokens: int, dtype: torch.dtype | None = None, flops_per_param: int = 2,
                 launches: int = 1) -> float:
    """One pass of a model over `tokens` tokens on a T4 (a forward by default; 6 FLOPs and 3 launches: a step)."""
    n = parameter_count(config)
    return max(flops_per_param * n * tokens / T4_SUSTAINED[dtype], n * (2 if dtype else 4) / T4_BANDWIDTH,
               launches * (config.n_layers * LAUNCH_S_PER_BLOCK + LAUNCH_S_PER_CALL))


def training_seconds(config: GPTConfig, steps: int, tokens_per_step: int, dtype: torch.dtype | None) -> float:
    """`steps` training steps of `tokens_per_step` tokens each on a T4."""
    return steps * pass_seconds(config, tokens_per_step, dtype, flops_per_param=6, launches=3)
