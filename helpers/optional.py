"""Optional packages (GPU extras): report their versions, and fail with an install hint when needed."""

from __future__ import annotations

import importlib
from importlib import metadata
from types import ModuleType

# import name -> (distribution name, how to get it and what the course does without it)
OPTIONAL_PACKAGES = {
    "flash_attn": (
        "flash-attn",
        "`pip install flash-attn --no-build-isolation` on a CUDA GPU with compute capability 8.0+ "
        "(Ampere or newer); without it the course uses PyTorch SDPA",
    ),
    "triton": (
        "triton",
        "`pip install triton` (Linux; runs kernels on NVIDIA/AMD GPUs, or on CPU with TRITON_INTERPRET=1)",
    ),
}


class MissingOptionalPackage(ImportError):
    """An optional package is needed for what was asked and is not installed."""


def version_of(module: str) -> str | None:
    """Installed version of an optional package, or None."""
    dist = OPTIONAL_PACKAGES[module][0] if module in OPTIONAL_PACKAGES else module
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def require(module: str, purpose: str) -> ModuleType:
    """Import an optional package, or raise a one-line error saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        dist, hint = OPTIONAL_PACKAGES.get(module, (module, f"`pip install {module}`"))
        raise MissingOptionalPackage(f"{purpose} needs the optional package {dist}: {hint}") from err
