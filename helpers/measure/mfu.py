"""What the hardware makes of a GPT's FLOPs: the device's peak, model FLOPs utilization (MFU), throughput.

MFU (PaLM's definition) is the model's FLOPs per second, with no credit for recomputation, over the device's
peak: a datasheet's dense tensor-core figure for a known GPU, or a large matmul measured on this device.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.gpt import GPT
from ..system.device import dtype_name
from .batch_size import make_training_step
from .calibration import load_calibration
from .flops import check_shape, forward_flops, training_step_flops
from .timing import interleaved

# Dense peak TFLOP/s from NVIDIA's datasheets (SXM unless named): tensor cores for tf32/bf16/fp16 (without the
# 2:4-sparsity doubling), CUDA cores for float32. A key is missing where the GPU has no such tensor cores.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "T4": {"float32": 8.1, "float16": 65.0},
    "V100 SXM2": {"float32": 15.7, "float16": 125.0},
    "V100 PCIe": {"float32": 14.0, "float16": 112.0},
    "A10": {"float32": 31.2, "tf32": 62.5, "bfloat16": 125.0, "float16": 125.0},
    # AWS's variant of the A10 has no NVIDIA datasheet; these are the figures AWS and NVIDIA quote for it.
    "A10G": {"float32": 31.2, "tf32": 35.0, "bfloat16": 70.0, "float16": 70.0},
    "L4": {"float32": 30.3, "tf32": 60.0, "bfloat16": 121.0, "float16": 121.0},
    "A100": {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},  # SXM4 and PCIe alike
    "H100 SXM": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
    "H100 PCIe": {"float32": 51.0, "tf32": 378.0, "bfloat16": 756.0, "float16": 756.0},
    "H100 NVL": {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5},
    "H200 SXM": {"float32": 67.0, "tf32": 494.7, "bfloat16": 989.4, "float16": 989.4},
    "H200 NVL": {"float32": 60.0, "tf32": 417.5, "bfloat16": 835.5, "float16": 835.5},
}


# (pattern on torch.cuda.get_device_name(), table key); first match wins, so specific names come first.
_GPU_NAMES = [
    (r"\bT4\b", "T4"),
    (r"V100.*PCIE", "V100 PCIe"), (r"V100", "V100 SXM2"),
    (r"\bA10G\b", "A10G"), (r"\bA10\b", "A10"),
    (r"\bL4\b", "L4"),
    (r"A100", "A100"),
    (r"H100.*PCIE", "H100 PCIe"), (r"H100.*NVL", "H100 NVL"), (r"H100", "H100 SXM"),
    (r"H200.*NVL", "H200 NVL"), (r"H200", "H200 SXM"),
]


def gpu_model(device_name: str) -> str | None:
    """The PEAK_TFLOPS key for a CUDA device name ("NVIDIA A100-SXM4-80GB" -> "A100"), or None if unknown."""
    for pattern, key in _GPU_NAMES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def datasheet_peak_flops(device_name: str, dtype: torch.dtype | str | None) -> float | None:
    """Dense peak FLOP/s of a known GPU for a dtype (None = float32), or None when the table has no figure."""
    model = gpu_model(device_name)
    tflops = PEAK_TFLOPS.get(model, {}).get(dtype_name(dtype)) if model else None
    return None if tflops is None else tflops * 1e12


@dataclass(frozen=True)
class PeakFlops:
    flops: float  # FLOP/s
    source: str  # "datasheet (A100, bfloat16)" or "measured (2048³ matmul, float32)"


def peak_flops(device_name: str, device_type: str, dtype: torch.dtype | None,
               measure: Callable[[], float] | None = None) -> PeakFlops:
    """The peak MFU divides by: the datasheet's dense figure for a known GPU, else this device's measured matmul
    (by default this machine's cached calibration, `helpers.measure.calibration`)."""
    if device_type == "cuda":
        sheet = datasheet_peak_flops(device_name, dtype)
        if sheet is not None:
            return PeakFlops(sheet, f"datasheet ({gpu_model(device_name)}, {dtype_name(dtype)})")
    if measure is None:
        def measure():
            return load_calibration(device_type, (dtype_name(dtype),)).peak(dtype)
    return PeakFlops(measure(), f"measured (fastest large matmul on this {device_type}, {dtype_name(dtype)})")


def mfu(achieved_flops_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilization: the model's FLOPs per second (no recomputation credited) over the peak."""
    if peak_flops_per_s <= 0:
        raise ValueError(f"the peak must be positive FLOP/s, got {peak_flops_per_s}")
    return achieved_flops_per_s / peak_flops_per_s


@dataclass
class Throughput:
    mode: str  # "forward" (inference, no gradients) or "train" (forward + backward + AdamW step)
    batch: int
    seq: int
    dtype: str  # autocast dtype, or float32
    seconds: float  # median seconds per step
    seconds_iqr: tuple[float, float]  # first and third quartile of the timed rounds
    tokens_per_s: float
    flops_per_step: int  # analytic model FLOPs (training: 3x forward)
    flops_per_s: float


def measure_throughput(model: GPT, mode: str, batch: int, seq: int, dtype: torch.dtype | None = None,
                       min_run_time: float = 1.0, rounds: int = 7) -> Throughput:
    """Time of a forward pass or a training step (forward, backward, AdamW) on random tokens, as tokens/s and model
    FLOP/s: median and interquartile range of `rounds` timed samples of at least `min_run_time / rounds` seconds."""
    if mode not in ("forward", "train"):
        raise ValueError(f"unknown mode {mode!r}; valid modes: forward, train")
    config = model.config
    check_shape(config, batch, seq)
    device = next(model.parameters()).device
    if mode == "forward":
        flops = forward_flops(config, batch, seq).total()
        idx = torch.randint(config.vocab_size, (batch, seq), device=device)
        model.eval()

        def step():
            with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                return model(idx)
    else:
        flops = training_step_flops(config, batch, seq)
        train_step = make_training_step(model, seq, dtype)

        def step():
            train_step(batch)
    timed = interleaved({mode: step}, device, rounds=rounds, min_sample_s=min_run_time / rounds)[mode]
    seconds = timed.median
    return Throughput(mode, batch, seq, dtype_name(dtype), seconds, timed.quartiles, batch * seq / seconds, flops,
                      flops / seconds)
