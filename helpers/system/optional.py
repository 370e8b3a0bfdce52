"""Optional packages (GPU extras): report their versions, fail with an install hint when needed, and keep the
log lines they are known to print for no reason off the learner's screen."""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from types import ModuleType

import torch

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


FOUND_VERSIONS: dict[str, str] = {}


def version_of(module: str) -> str | None:
    """Installed version of an optional package, or None.

    A version found is remembered for the process: a metadata lookup takes 0.2-1.4 ms, more than a whole attention
    forward that asks whether flash-attn is installed. A missing package is looked up again, so one installed
    mid-session is seen.
    """
    if module not in FOUND_VERSIONS:
        dist = OPTIONAL_PACKAGES[module][0] if module in OPTIONAL_PACKAGES else module
        try:
            FOUND_VERSIONS[module] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None
    return FOUND_VERSIONS[module]


def require(module: str, purpose: str) -> ModuleType:
    """Import an optional package, or raise a one-line error saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        dist, hint = OPTIONAL_PACKAGES.get(module, (module, f"`pip install {module}`"))
        raise MissingOptionalPackage(f"{purpose} needs the optional package {dist}: {hint}") from err


class ExpectedLibraryLogs(logging.Filter):
    """Drop the lines torchao logs on import that are expected with a CPU-only PyTorch, and nothing else.

    torchao ships CUDA kernel libraries (`_C_*.so`, linked against libc10_cuda) and tries to load them on
    import; a CPU-only PyTorch has no CUDA libraries, so each load fails with a "Failed to load" warning.
    PyTorch also logs that torchao registers an Enum with a since-deprecated pytree call. With a CUDA build
    of PyTorch nothing is dropped: a library that fails to load there is a real problem.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cuda_library = message.startswith("Failed to load") and "_C" in message and ".so" in message
        enum_note = "is an Enum subclass" in message and "register_constant" in message
        return not (torch.version.cuda is None and (cuda_library or enum_note))


EXPECTED_LOGS_FROM = ("torchao", "torch.utils._pytree")  # the loggers ExpectedLibraryLogs watches


def quiet_expected_library_logs() -> None:
    """Attach `ExpectedLibraryLogs` to the loggers it watches (once). `import helpers` does this, so torchao is quiet
    however it is imported: by the course, or by transformers when it saves or loads a model."""
    for name in EXPECTED_LOGS_FROM:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ExpectedLibraryLogs) for f in logger.filters):
            logger.addFilter(ExpectedLibraryLogs())
