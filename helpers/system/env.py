"""The environment report: what this machine can run, printed by `python -m helpers env`."""

from __future__ import annotations

import datetime
import json
import platform
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .cli import Command, add_json
from .device import DeviceCapabilities, autocast_dtype, detect_capabilities, dtype_name, needs_grad_scaler
from .scale import current_scale


def usable_sdpa_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """SDPA backends that actually run a small causal attention here (tried, not guessed)."""
    q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype)
    usable = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")  # each refusal also warns; the list says it all
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            usable.append(backend.name.lower())
        except RuntimeError:
            pass
    return usable


def environment_report(caps: DeviceCapabilities | None = None) -> dict:
    """Everything the course's hardware decisions depend on, as one JSON-ready dict."""
    caps = detect_capabilities() if caps is None else caps
    dtype = autocast_dtype(caps)
    sdpa_dtype = torch.float32 if dtype is None else dtype
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "device": caps.device_type,
        "device_name": caps.name,
        "compute_capability": ".".join(map(str, caps.compute_capability)) if caps.compute_capability else None,
        "memory_gib": round(caps.total_memory_bytes / 2**30, 1) if caps.total_memory_bytes else None,
        "bf16": caps.bf16_native,
        "autocast_dtype": dtype_name(dtype) if dtype else "float32 (no autocast)",
        "grad_scaler": needs_grad_scaler(dtype),
        "sdpa_backends": usable_sdpa_backends(caps.device, sdpa_dtype),
        "sdpa_dtype": dtype_name(sdpa_dtype),
        "flash_attn": caps.flash_attn,
        "triton": caps.triton,
        "cpu_threads": caps.cpu_threads,
        "scale": current_scale(caps.device_type),
    }


def format_report(report: dict) -> str:
    """The report as aligned `key: value` lines."""
    width = max(map(len, report))
    lines = []
    for key, value in report.items():
        if isinstance(value, list):
            value = ", ".join(value) or "none"
        elif value is None:
            value = "not installed" if key in ("flash_attn", "triton") else "n/a"
        lines.append(f"{key:<{width}} : {value}")
    return "\n".join(lines)


def environment_line() -> str:
    """One line for a notebook's first cell: versions, device, precision, scale."""
    r = environment_report()
    return (f"torch {r['torch']} | python {r['python']} | {r['device']}: {r['device_name']} "
            f"({r['cpu_threads']} CPU threads) | autocast {r['autocast_dtype']} | scale {r['scale']} | "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}")


def capability_checks(report: dict) -> list[tuple[bool, str, str]]:
    """(ok, what, detail) lines for the setup check: capabilities, which never fail the install."""
    return [
        (True, "device", f"{report['device']}: {report['device_name']}"),
        (report["bf16"], "native bf16", "autocast " + report["autocast_dtype"]),
        ("flash_attention" in report["sdpa_backends"], "SDPA flash backend",
         f"usable in {report['sdpa_dtype']}: {', '.join(report['sdpa_backends']) or 'none'}"),
        (report["flash_attn"] is not None, "flash-attn (optional GPU extra)",
         report["flash_attn"] or "not installed: attention uses PyTorch SDPA"),
        (report["triton"] is not None, "triton (optional)",
         report["triton"] or "not installed: Triton kernels are skipped"),
    ]


def _arguments(parser) -> None:
    add_json(parser)


def _run(args) -> int:
    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


COMMAND = Command("env", "print the environment report", _arguments, _run)
