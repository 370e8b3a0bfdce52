"""The precision policy of a training run, in one place: the names a run accepts (auto, float32, bfloat16,
float16), what "auto" picks on this device, and the refusal of a dtype the device cannot run natively."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..system.device import DeviceCapabilities, autocast_dtype, check_dtype, dtype_name, needs_grad_scaler
from .step import autocast_context

PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}  # name -> autocast dtype


def check_precision_name(precision: str) -> None:
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: auto, {', '.join(PRECISIONS)}")


@dataclass(frozen=True)
class Precision:
    """The autocast dtype of a run (None: plain fp32) and whether it needs loss scaling."""

    device_type: str
    dtype: torch.dtype | None

    @property
    def name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def needs_scaler(self) -> bool:
        return needs_grad_scaler(self.dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast_context(self.device_type, self.dtype)


def resolve_precision(precision: str, caps: DeviceCapabilities) -> Precision:
    """"auto": bf16 where native, fp16 on tensor-core GPUs without bf16, fp32 elsewhere (helpers.system.device);
    an explicit dtype the device cannot run natively is refused with what to use instead."""
    check_precision_name(precision)
    if precision == "auto":
        return Precision(caps.device_type, autocast_dtype(caps))
    dtype = PRECISIONS[precision]
    return Precision(caps.device_type, dtype if dtype is None else check_dtype(caps, dtype))
