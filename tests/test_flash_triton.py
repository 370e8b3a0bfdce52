"""FlashAttention-2 in Triton (`helpers.model.flash_triton`) against a float64 reference, on CPU through
Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported in a process (triton 3.9 reads it whenever
`@triton.jit` decorates, and triton.language decorates its own helpers at import). In a pytest run another
module may already have imported triton, so the kernels run in a fresh Python with TRITON_INTERPRET=1,
once for all cases. bfloat16 is not run: the interpreter does not support it (its tl.dot multiplies the raw
bits); float16 is. The compiled path, which the interpreter does not exercise, is checked by compiling the
kernels for an H100 (sm_90) without launching them: that needs no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers.model.flash_triton import (
    compute_capability_reason,
    flash_attention_triton,
    launch_config,
    triton_unavailable_reason,
)
from helpers.system.device import REFERENCE_DEVICES
from helpers.system.optional import MissingOptionalPackage

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="optional package triton is not installed (pip install triton)"
)

# (batch, heads, seq, head_dim, causal, dtype): seq 1, seqs that are not multiples of the interpreter's tiles
# (16 and 32), head_dim 24 (padded to 32) and 8 (padded to 16).
CASES = [
    (1, 1, 1, 16, True, "float32"),
    (2, 2, 37, 24, True, "float32"),
    (1, 2, 67, 32, False, "float32"),
    (1, 1, 67, 16, True, "float32"),
    (2, 1, 37, 8, False, "float32"),
    (1, 2, 37, 32, True, "float16"),
]
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}  # max error relative to max(1, max |reference|)


def case_id(case) -> str:
    batch, heads, seq, head_dim, causal, dtype = case
    return f"{batch}x{heads}x{seq}x{head_dim}-{'causal' if causal else 'full'}-{dtype}"


KERNEL_SCRIPT = """
import json, sys, torch
from helpers.model.flash_triton import flash_attention_triton, triton_unavailable_reason

def reference(q, k, v, causal):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v

def error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1)).item()

torch.manual_seed(0)
errors = {}
for case_id, (batch, heads, seq, head_dim, causal, dtype) in json.loads(sys.argv[1]).items():
    shape, dtype = (batch, heads, seq, head_dim), getattr(torch, dtype)
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, dtype=dtype)
    out = flash_attention_triton(q, k, v, causal=causal)
    out.backward(grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference(q64, k64, v64, causal)
    want.backward(grad_out.double())
    errors[case_id] = {"out": error(out, want), "dq": error(q.grad, q64.grad),
                       "dk": error(k.grad, k64.grad), "dv": error(v.grad, v64.grad)}
reasons = {str(d).removeprefix("torch."): triton_unavailable_reason("cpu", d)
           for d in (torch.float32, torch.float16, torch.bfloat16)}
print(json.dumps({"errors": errors, "reasons": reasons}))
"""

NO_INTERPRETER_SCRIPT = """
import json, os, sys, torch
import helpers.model.flash_triton as ft
lazy = "triton" not in sys.modules
try:
    ft.flash_attention_triton(*(torch.randn(1, 1, 4, 16) for _ in range(3)))
    raised = None
except RuntimeError as err:
    raised = str(err)
off = ft.triton_unavailable_reason("cpu", torch.float32)
# The GPU path, without a GPU: compile each kernel for an H100 (sm_90) as a launch would, bf16, head_dim 64.
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
kernels, cfg = ft.compiled_kernels(), ft.launch_config(64, torch.bfloat16, interpret=False)
scalar_types = {"LSE": "*fp32", "DELTA": "*fp32", "seq_len": "i32", "sm_scale": "fp32"}
shared = {}
for name, blocks in [("fwd", (cfg.fwd_m, cfg.fwd_n)), ("bwd_dkdv", (cfg.dkdv_m, cfg.dkdv_n)),
                     ("bwd_dq", (cfg.dq_m, cfg.dq_n))]:
    kernel = getattr(kernels, name)
    signature = {p.name: "constexpr" if p.is_constexpr else scalar_types.get(p.name, "*bf16") for p in kernel.params}
    constants = dict(CAUSAL=True, HEAD_DIM=64, BLOCK_M=blocks[0], BLOCK_N=blocks[1], DOT_PRECISION="tf32")
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    shared[name] = compiled.metadata.shared
torch.cuda.is_available, torch.cuda.get_device_capability = lambda: True, lambda device=None: (7, 5)  # a T4
t4 = ft.triton_unavailable_reason("cuda", torch.float16)
os.environ["TRITON_INTERPRET"] = "1"  # too late: triton is imported
late = ft.triton_unavailable_reason("cpu", torch.float32)
print(json.dumps({"lazy": lazy, "raised": raised, "off": off, "late": late, "shared": shared, "t4": t4}))
"""


def run_python(python_process, script: str, *args: str, interpret: bool) -> dict:
    """Run `script` in a fresh Python (with or without TRITON_INTERPRET=1); its last stdout line is JSON."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = python_process("-c", script, *args, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted(python_process):
    return run_python(python_process, KERNEL_SCRIPT, json.dumps({case_id(c): c for c in CASES}), interpret=True)


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_gradients_match_float64_reference(interpreted, case):
    errors = interpreted["errors"][case_id(case)]
    assert all(error < TOLERANCE[case[-1]] for error in errors.values()), errors  # False for NaN


@needs_triton
def test_reasons_under_the_interpreter(interpreted):
    reasons = interpreted["reasons"]
    assert reasons["float32"] is None and reasons["float16"] is None
    assert "interpreter does not support bfloat16" in reasons["bfloat16"]


@pytest.fixture(scope="module")
def not_interpreted(python_process):
    return run_python(python_process, NO_INTERPRETER_SCRIPT, interpret=False)


@needs_triton
def test_cpu_without_the_interpreter_is_refused_and_triton_is_imported_lazily(not_interpreted):
    assert not_interpreted["lazy"], "import helpers.model.flash_triton must not import triton"
    assert "set TRITON_INTERPRET=1" in not_interpreted["off"]
    assert not_interpreted["raised"] == f"flash_attention_triton cannot run here: {not_interpreted['off']}"
    assert "changed after triton was imported" in not_interpreted["late"]


@needs_triton
def test_kernels_compile_for_an_h100(not_interpreted):
    # The interpreter runs any Python; this is the check that the compiler accepts the kernels.
    for kernel, shared_bytes in not_interpreted["shared"].items():
        assert 0 < shared_bytes <= 227 * 1024, kernel  # an H100 gives a block at most 227 KiB


def test_gpus_below_compute_capability_8_are_refused():
    # Triton supports 8.0+; on a T4 the backward kernels ask for more shared memory than a block gets.
    reason = compute_capability_reason(REFERENCE_DEVICES["t4"].compute_capability)
    assert "compute capability 8.0+" in reason and "not 7.5" in reason and "sdpa" in reason
    assert compute_capability_reason(REFERENCE_DEVICES["a100"].compute_capability) is None  # 8.0
    assert compute_capability_reason(REFERENCE_DEVICES["h100"].compute_capability) is None  # 9.0


@needs_triton
def test_compiled_kernels_are_refused_on_a_t4(not_interpreted):
    assert "compute capability 8.0+" in not_interpreted["t4"]


def test_reasons_that_need_no_triton():
    assert triton_unavailable_reason("mps", torch.float16) == "Apple MPS is not supported by Triton"
    assert triton_unavailable_reason("cpu", torch.float64) == "float64 is not supported (use fp16/bf16/fp32)"
    with pytest.raises(RuntimeError, match="float64 is not supported"):
        flash_attention_triton(*(torch.randn(1, 1, 4, 16, dtype=torch.float64) for _ in range(3)))


def test_missing_triton_raises_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    assert triton_unavailable_reason("cpu", torch.float32) == "triton is not installed"
    with pytest.raises(MissingOptionalPackage, match="pip install triton"):
        flash_attention_triton(*(torch.randn(1, 1, 4, 16) for _ in range(3)))


@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tiles_fit_the_masked_unmasked_split(dtype, interpret):
    for head_dim in (16, 32, 64, 128, 256):
        cfg = launch_config(head_dim, dtype, interpret)
        for tile in cfg[:6]:
            assert tile >= 16 and tile & (tile - 1) == 0, cfg  # tl.dot: power of two, at least 16
        assert cfg.fwd_m % cfg.fwd_n == 0 and cfg.dkdv_n % cfg.dkdv_m == 0 and cfg.dq_m % cfg.dq_n == 0, cfg
