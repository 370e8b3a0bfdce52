"""One switch, three scales: the same code runs everywhere, only sizes change.

`COURSE_SMOKE=1` selects the *smoke* scale (CI: about a minute per notebook on 2 CPU cores).
Otherwise the scale follows the hardware: "gpu" on a CUDA GPU, "cpu" elsewhere (CPU or Apple MPS).
"""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")

SCALES = ("smoke", "cpu", "gpu")
SMOKE_ENV = "COURSE_SMOKE"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def smoke_requested(environ: dict[str, str] | None = None) -> bool:
    """True when `COURSE_SMOKE` asks for the smoke scale; a value we cannot read is an error."""
    value = (os.environ if environ is None else environ).get(SMOKE_ENV, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{SMOKE_ENV}={value!r} is not understood: set it to 1 (smoke scale) or 0 / unset.")


def scale_for(device_type: str, smoke: bool) -> str:
    """The scale for a device type ("cuda", "mps", "cpu"): a pure function, tested per device."""
    if smoke:
        return "smoke"
    return "gpu" if device_type == "cuda" else "cpu"


def current_scale(device_type: str | None = None) -> str:
    """The scale of this run: smoke if requested, else by the device the course would use."""
    if device_type is None:
        from .device import detect_capabilities

        device_type = detect_capabilities().device_type
    return scale_for(device_type, smoke_requested())


def by_scale(scale: str, *, smoke: T, cpu: T, gpu: T) -> T:
    """Pick the value for `scale`; notebooks write their three sizes side by side with it."""
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; valid scales: {', '.join(SCALES)}")
    return {"smoke": smoke, "cpu": cpu, "gpu": gpu}[scale]
