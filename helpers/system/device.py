"""Hardware capabilities and the decisions that follow from them.

`detect_capabilities()` reads the machine into a `DeviceCapabilities` record; every decision
(device, autocast dtype, gradient scaler) is a pure function of that record, so the GPU paths are
tested with records for a T4, an A100 or an H100 on a machine without one.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from .optional import version_of


@dataclass(frozen=True)
class DeviceCapabilities:
    device_type: str  # "cuda", "mps" or "cpu"
    name: str
    compute_capability: tuple[int, int] | None = None  # CUDA only
    total_memory_bytes: int | None = None
    bf16_native: bool = False  # bfloat16 runs in hardware (not emulated)
    cpu_threads: int = 1
    flash_attn: str | None = None  # installed version of the optional package
    triton: str | None = None

    @property
    def device(self) -> torch.device:
        return torch.device(self.device_type)


# Records of common hardware, for tests and for the README's hardware matrix. A GPU's memory is what torch reports
# as its total (the card's nominal size less what the driver reserves), rounded down: 14.7 GiB on a 16 GB T4.
REFERENCE_DEVICES = {
    "cpu": DeviceCapabilities("cpu", "x86-64 CPU with AVX-512 BF16", None, 16 << 30, True, 8),
    "cpu-no-bf16": DeviceCapabilities("cpu", "x86-64 CPU with AVX2", None, 16 << 30, False, 8),
    "mps": DeviceCapabilities("mps", "Apple M2", None, 16 << 30, True, 8),
    "t4": DeviceCapabilities("cuda", "Tesla T4", (7, 5), int(14.7 * (1 << 30)), False, 2),
    "l4": DeviceCapabilities("cuda", "NVIDIA L4", (8, 9), 22 << 30, True, 12),
    "a100": DeviceCapabilities("cuda", "NVIDIA A100-SXM4-40GB", (8, 0), 39 << 30, True, 12, "2.7.4", "3.3.0"),
    "h100": DeviceCapabilities("cuda", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, True, 16, "2.7.4", "3.3.0"),
}


class UnsupportedDtypeError(ValueError):
    """The requested dtype does not run natively on this device."""


def default_device_type() -> str:
    """CUDA if present, else Apple MPS, else CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _cpu_bf16_native() -> bool:
    # oneDNN's own test: AVX-512 BF16 / AMX on x86, BF16 extensions on Arm.
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _mps_bf16_native() -> bool:
    try:
        torch.ones(1, dtype=torch.bfloat16, device="mps") + 1
        return True
    except (RuntimeError, TypeError):
        return False


def detect_capabilities(device: str | torch.device | None = None) -> DeviceCapabilities:
    """Read this machine's capabilities for `device` ("cuda", "cuda:1", "cpu"...; default: the best available)."""
    try:
        device = torch.device(default_device_type() if device is None else device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; valid: cuda, mps, cpu, with an index or without") from None
    device_type = device.type
    common = dict(cpu_threads=torch.get_num_threads(), flash_attn=version_of("flash_attn"),
                  triton=version_of("triton"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but no CUDA GPU is visible; use 'cpu' (or 'mps' on a Mac)")
        props = torch.cuda.get_device_properties(device.index or 0)
        return DeviceCapabilities(
            "cuda", props.name, (props.major, props.minor), props.total_memory,
            torch.cuda.is_bf16_supported(including_emulation=False), **common,
        )
    if device_type == "mps":
        if not torch.backends.mps.is_available():
            raise RuntimeError("device 'mps' requested but Apple MPS is not available; use 'cpu'")
        memory = torch.mps.recommended_max_memory() if hasattr(torch.mps, "recommended_max_memory") else None
        return DeviceCapabilities("mps", f"Apple MPS ({platform.machine()})", None, memory,
                                  _mps_bf16_native(), **common)
    if device_type == "cpu":
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = None
        return DeviceCapabilities("cpu", _cpu_name(), None, memory, _cpu_bf16_native(), **common)
    raise ValueError(f"unknown device {str(device)!r}; valid: cuda, mps, cpu, with an index or without")


def autocast_dtype(caps: DeviceCapabilities) -> torch.dtype | None:
    """The mixed-precision dtype to train with, or None for plain fp32.

    bf16 where the hardware has it (Ampere+ GPUs, recent CPUs and Apple GPUs): same range as fp32,
    no loss scaling. fp16 on tensor-core GPUs without bf16 (Volta, Turing: V100, T4), which needs a
    GradScaler. fp32 elsewhere: emulated bf16 or fp16 without tensor cores is slower, not faster.
    """
    if caps.bf16_native:
        return torch.bfloat16
    if caps.device_type == "cuda" and caps.compute_capability is not None and caps.compute_capability >= (7, 0):
        return torch.float16
    return None


def needs_grad_scaler(dtype: torch.dtype | None) -> bool:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 need none."""
    return dtype == torch.float16


def check_dtype(caps: DeviceCapabilities, dtype: torch.dtype) -> torch.dtype:
    """Refuse a dtype the device cannot run natively, saying what to use instead."""
    if dtype == torch.bfloat16 and not caps.bf16_native:
        if caps.device_type == "cuda":
            fix = "use torch.float16 with torch.amp.GradScaler (or float32)"
        else:
            fix = "use torch.float32"
        raise UnsupportedDtypeError(f"bfloat16 is not native on {caps.name}: {fix}")
    if dtype == torch.float16 and caps.device_type == "cuda" and caps.compute_capability < (7, 0):
        raise UnsupportedDtypeError(f"{caps.name} has no fp16 tensor cores: use torch.float32")
    return dtype


# The floating-point dtypes the course's commands and scripts accept, by the name torch gives them.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def dtype_name(dtype: torch.dtype | None) -> str:
    """"bfloat16" for torch.bfloat16; None (no autocast) is float32."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.bfloat16 for "bfloat16"; an unknown name is an error that lists the valid ones."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid dtypes: {', '.join(DTYPES)}")
    return DTYPES[name]


def synchronize(device: torch.device | str) -> None:
    """Wait until the device has finished its queued work, so a clock or a memory reading sees it done (CPU
    work is done when the call returns)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
