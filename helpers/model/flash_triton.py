"""FlashAttention-2 written from scratch in Triton: forward and backward, causal or not.

The algorithm is the one of Dao, "FlashAttention-2" (2023). Each forward program owns a block of queries,
streams blocks of keys and values through on-chip memory and keeps a running softmax (row max m_i, row
sum l_i), so the seq x seq score matrix S never reaches HBM. The forward pass also saves each row's
log-sum-exp L; the backward pass recomputes P = exp(S - L) block by block instead of storing it, with one
kernel for dK, dV (programs over key blocks) and one for dQ (programs over query blocks): no atomics, so
gradients are deterministic.

Triton is imported on first use, so `import helpers.model.flash_triton` works without it. On CPU the kernels run
in Triton's interpreter (numpy; slow, for tests). TRITON_INTERPRET must be set before triton is first
imported (simplest: before Python starts): triton 3.9 reads it (`triton.knobs.runtime.interpret`, live from
the environment) each time `@triton.jit` decorates a function, and triton.language's own helpers (tl.zeros,
tl.sum, ...) are decorated at import, ours on first use; the two must agree, and
`triton_unavailable_reason` says so when they do not. The interpreter does not support bfloat16.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import types
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ..system.device import dtype_name
from ..system.optional import require

if TYPE_CHECKING:  # for readers and linters; at run time `compiled_kernels()` binds it in the kernels' globals
    import triton.language as tl

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # as FlashAttention-2: larger tiles no longer fit in registers and shared memory
_NOT_INSTALLED = "triton is not installed"
LOG2E = math.log2(math.e)  # exp(x) = exp2(x * log2(e)): exp2 is the fast hardware instruction
LN2 = math.log(2.0)


def _interpreter_mode(triton) -> bool | None:
    """Whether Triton runs kernels in its interpreter; None if TRITON_INTERPRET changed since `import triton`.

    Now: what `@triton.jit` reads (`triton.knobs`, or the variable itself in versions without knobs). At
    import: whether triton.language's own jitted helpers became interpreted functions.
    """
    from triton.runtime.interpreter import InterpretedFunction

    knobs = getattr(triton, "knobs", None)
    now = bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET", "0") == "1"
    at_import = isinstance(importlib.import_module("triton.language").zeros, InterpretedFunction)
    return now if now == at_import else None


def compute_capability_reason(compute_capability: tuple[int, int]) -> str | None:
    """None when the compiled kernels can run on a CUDA GPU of this compute capability, else why not.

    Triton supports 8.0+. On a T4 (7.5) tl.dot runs on the FMA units (no tensor cores), the forward pass takes
    all 64 KiB of shared memory a block gets (and spills registers), and the backward kernels need 80 KiB.
    """
    if compute_capability >= (8, 0):
        return None
    major, minor = compute_capability
    return (f"Triton supports GPUs of compute capability 8.0+ (Ampere or newer), not {major}.{minor} (a T4 lacks the "
            "shared memory for the backward pass): use attn_implementation='sdpa'")


def triton_unavailable_reason(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """None when `flash_attention_triton` can run on this device and dtype, else a one-line reason."""
    device = torch.device(device)
    if dtype not in SUPPORTED_DTYPES:
        return f"{dtype_name(dtype)} is not supported (use fp16/bf16/fp32)"
    if device.type == "mps":
        return "Apple MPS is not supported by Triton"
    try:
        triton = importlib.import_module("triton")
    except ImportError:
        return _NOT_INSTALLED
    interpret = _interpreter_mode(triton)
    if interpret is None:
        return "TRITON_INTERPRET changed after triton was imported: set it before Python starts"
    if interpret:  # runs on any device: the interpreter copies tensors to host memory and back
        if dtype == torch.bfloat16:
            return "Triton's interpreter does not support bfloat16 (its tl.dot multiplies the raw bits): use fp16/fp32"
        return None
    if device.type == "cpu":
        return "on CPU Triton kernels run only in its interpreter: set TRITON_INTERPRET=1 before Python starts"
    if device.type != "cuda":
        return f"Triton does not run on {device.type} tensors"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return compute_capability_reason(torch.cuda.get_device_capability(device))


class LaunchConfig(NamedTuple):
    fwd_m: int  # forward: queries per program
    fwd_n: int  # forward: keys per loop step
    dkdv_m: int  # backward dK/dV: queries per loop step
    dkdv_n: int  # backward dK/dV: keys per program
    dq_m: int  # backward dQ: queries per program
    dq_n: int  # backward dQ: keys per loop step
    num_warps: int
    num_stages: int


def launch_config(head_dim: int, dtype: torch.dtype, interpret: bool) -> LaunchConfig:
    """Tile sizes: large enough to keep the tensor cores busy, small enough for registers and shared memory.

    The split between masked and unmasked blocks needs the block owned by a program to be a multiple of
    the block it loops over (fwd_m % fwd_n == 0 and so on). Under the interpreter tiles are small (16 is
    the smallest tl.dot) so tests are fast. On the GPU (not autotuned, not timed here): the 128 x 64 forward
    tiles of FlashAttention-2 and Triton's fused-attention tutorial, with 8 warps: Triton 3.9 compiles these
    for sm_80 and sm_90 without register spills (ptxas -v; with 4 warps they spill), except the head_dim 128
    forward on sm_80 (88 bytes). fp32 "ieee" dots run on the FMA units, not tensor cores: small tiles.
    """
    if interpret:  # the GPU's 2:1 shapes, scaled down
        return LaunchConfig(32, 16, 16, 32, 32, 16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        if head_dim <= 128:
            return LaunchConfig(32, 32, 32, 32, 32, 32, num_warps=4 if head_dim <= 64 else 8, num_stages=2)
        return LaunchConfig(32, 32, 16, 32, 32, 16, num_warps=8, num_stages=1)
    if head_dim <= 64:
        return LaunchConfig(128, 64, 32, 128, 128, 32, num_warps=8, num_stages=3)
    if head_dim <= 128:
        return LaunchConfig(128, 64, 32, 64, 64, 32, num_warps=8, num_stages=2)
    return LaunchConfig(64, 32, 32, 32, 32, 32, num_warps=8, num_stages=2)


# ---- the kernels: plain functions here, compiled by `compiled_kernels()` on first use ----
# Their globals are a private namespace that `compiled_kernels()` fills with `tl`, the constants and the jitted
# helpers (so triton stays optional); the annotations are strings thanks to `from __future__ import annotations`.


def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, lo, hi, seq_len, qk_scale,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """Online softmax over key blocks [lo, hi); MASKED blocks cross the diagonal or the end of the sequence."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_offs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(k_base + kv_offs, mask=(offs_n < seq_len)[:, None], other=0.0)
            v = tl.load(v_base + kv_offs, mask=(offs_n < seq_len)[:, None], other=0.0)
        else:
            k = tl.load(k_base + kv_offs)
            v = tl.load(v_base + kv_offs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASKED:
            visible = (offs_n < seq_len)[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(visible, s, float("-inf"))
        # Scores in log2 units; rescale what was accumulated so far by exp2(old max - new max).
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def _fwd_kernel(Q, K, V, Out, LSE, seq_len, sm_scale,
                CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """O and L = log-sum-exp of the scaled scores, for one block of queries of one (batch, head)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # int64: batch * heads * seq * head_dim can pass 2**31
    base = bh * seq_len * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < seq_len
    q_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + base + q_offs, mask=in_seq[:, None], other=0.0)
    qk_scale = sm_scale * LOG2E
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Key blocks left of the diagonal block and inside the sequence need no mask; only the rest pay for one.
    if CAUSAL:
        full_end = start_m
        end = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        full_end = (seq_len // BLOCK_N) * BLOCK_N
        end = seq_len
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + base, V + base, offs_m, offs_d, 0, full_end, seq_len,
                               qk_scale, BLOCK_N, HEAD_DIM, False, CAUSAL, DOT_PRECISION)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K + base, V + base, offs_m, offs_d, full_end, end, seq_len,
                               qk_scale, BLOCK_N, HEAD_DIM, True, CAUSAL, DOT_PRECISION)
    tl.store(Out + base + q_offs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=in_seq[:, None])
    tl.store(LSE + bh * seq_len + offs_m, m_i * LN2 + tl.log(l_i), mask=in_seq)


def _bwd_delta_kernel(Out, DO, DELTA, seq_len, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = rowsum(dO * O) = sum_j P_ij dP_ij: the term the softmax backward subtracts."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    in_seq = offs_m < seq_len
    offs = bh * seq_len * HEAD_DIM + offs_m[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(Out + offs, mask=in_seq[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=in_seq[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + bh * seq_len + offs_m, tl.sum(o * do, 1), mask=in_seq)


def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, offs_n, offs_d, lo, hi, seq_len,
                qk_scale, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the query blocks [lo, hi) to dK, dV of one key block; tiles are transposed (keys are rows)."""
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qo_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            in_seq = offs_m < seq_len
            q = tl.load(q_base + qo_offs, mask=in_seq[:, None], other=0.0)
            do = tl.load(do_base + qo_offs, mask=in_seq[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=in_seq, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=in_seq, other=0.0)
        else:
            q = tl.load(q_base + qo_offs)
            do = tl.load(do_base + qo_offs)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # P^T recomputed from the saved log-sum-exp: P = exp(S * scale - L).
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :] * LOG2E)
        if MASKED:
            visible = (offs_m < seq_len)[None, :]
            if CAUSAL:
                visible = visible & (offs_m[None, :] >= offs_n[:, None])
            p_t = tl.where(visible, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])  # softmax backward: dS = P * (dP - delta)
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, seq_len, sm_scale,
                     CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """dK and dV for one block of keys: loop over the query blocks that see them."""
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    base = bh * seq_len * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_n < seq_len
    kv_offs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + base + kv_offs, mask=in_seq[:, None], other=0.0)
    v = tl.load(V + base + kv_offs, mask=in_seq[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * LOG2E
    # Causal: queries before start_n see none of these keys, those on the diagonal block need the mask,
    # later ones see them all. The ragged last query block needs a mask either way.
    full_end = (seq_len // BLOCK_M) * BLOCK_M
    if CAUSAL:
        full_start = start_n + BLOCK_N
        dk, dv = _dkdv_inner(dk, dv, k, v, Q + base, DO + base, LSE + bh * seq_len, DELTA + bh * seq_len,
                             offs_n, offs_d, start_n, tl.minimum(full_start, seq_len), seq_len, qk_scale,
                             BLOCK_M, HEAD_DIM, True, CAUSAL, DOT_PRECISION)
    else:
        full_start = 0
    dk, dv = _dkdv_inner(dk, dv, k, v, Q + base, DO + base, LSE + bh * seq_len, DELTA + bh * seq_len,
                         offs_n, offs_d, full_start, full_end, seq_len, qk_scale,
                         BLOCK_M, HEAD_DIM, False, CAUSAL, DOT_PRECISION)
    dk, dv = _dkdv_inner(dk, dv, k, v, Q + base, DO + base, LSE + bh * seq_len, DELTA + bh * seq_len,
                         offs_n, offs_d, tl.maximum(full_start, full_end), seq_len, seq_len, qk_scale,
                         BLOCK_M, HEAD_DIM, True, CAUSAL, DOT_PRECISION)
    tl.store(DK + base + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=in_seq[:, None])
    tl.store(DV + base + kv_offs, dv.to(DV.dtype.element_ty), mask=in_seq[:, None])


def _dq_inner(dq, q, do, lse, delta, k_base, v_base, offs_m, offs_d, lo, hi, seq_len, qk_scale,
              BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """Add the key blocks [lo, hi) to dQ of one query block."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_offs = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            k = tl.load(k_base + kv_offs, mask=(offs_n < seq_len)[:, None], other=0.0)
            v = tl.load(v_base + kv_offs, mask=(offs_n < seq_len)[:, None], other=0.0)
        else:
            k = tl.load(k_base + kv_offs)
            v = tl.load(v_base + kv_offs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(s * qk_scale - lse[:, None] * LOG2E)
        if MASKED:
            visible = (offs_n < seq_len)[None, :]
            if CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, seq_len, sm_scale,
                   CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """dQ for one block of queries: the same key blocks, and the same split, as the forward pass."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    base = bh * seq_len * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    in_seq = offs_m < seq_len
    q_offs = offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + base + q_offs, mask=in_seq[:, None], other=0.0)
    do = tl.load(DO + base + q_offs, mask=in_seq[:, None], other=0.0)
    lse = tl.load(LSE + bh * seq_len + offs_m, mask=in_seq, other=0.0)
    delta = tl.load(DELTA + bh * seq_len + offs_m, mask=in_seq, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * LOG2E
    if CAUSAL:
        full_end = start_m
        end = tl.minimum(start_m + BLOCK_M, seq_len)
    else:
        full_end = (seq_len // BLOCK_N) * BLOCK_N
        end = seq_len
    dq = _dq_inner(dq, q, do, lse, delta, K + base, V + base, offs_m, offs_d, 0, full_end, seq_len, qk_scale,
                   BLOCK_N, HEAD_DIM, False, CAUSAL, DOT_PRECISION)
    dq = _dq_inner(dq, q, do, lse, delta, K + base, V + base, offs_m, offs_d, full_end, end, seq_len, qk_scale,
                   BLOCK_N, HEAD_DIM, True, CAUSAL, DOT_PRECISION)
    tl.store(DQ + base + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=in_seq[:, None])


_KERNEL_FUNCTIONS = (
    _fwd_inner, _fwd_kernel, _bwd_delta_kernel, _dkdv_inner, _bwd_dkdv_kernel, _dq_inner, _bwd_dq_kernel,
)


@functools.cache
def compiled_kernels() -> types.SimpleNamespace:
    """The kernels above, jitted (compiled, or interpreted under TRITON_INTERPRET=1) with their own globals.

    Triton's interpreter re-executes a kernel's source in the kernel's `__globals__` (closures are lost), hence a
    namespace of their own rather than nested functions.
    """
    triton = require("triton", "flash_attention_triton")
    tl = importlib.import_module("triton.language")
    scope = {"__name__": __name__, "tl": tl, "LOG2E": tl.constexpr(LOG2E), "LN2": tl.constexpr(LN2)}
    for fn in _KERNEL_FUNCTIONS:
        scope[fn.__name__] = triton.jit(types.FunctionType(fn.__code__, scope, fn.__name__))
    return types.SimpleNamespace(triton=triton, fwd=scope["_fwd_kernel"], bwd_delta=scope["_bwd_delta_kernel"],
                                 bwd_dkdv=scope["_bwd_dkdv_kernel"], bwd_dq=scope["_bwd_dq_kernel"])


def _setup(q: torch.Tensor) -> tuple[types.SimpleNamespace, LaunchConfig, str]:
    """Kernels, tile sizes and tl.dot precision (fp32 inputs follow PyTorch's TF32 setting; "tf32" is the default)."""
    interpret = bool(_interpreter_mode(require("triton", "flash_attention_triton")))
    exact = q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    precision = "ieee" if exact else "tf32"
    return compiled_kernels(), launch_config(q.shape[-1], q.dtype, interpret), precision


class _FlashAttention(torch.autograd.Function):
    """Forward saves (q, k, v, O, L); backward recomputes P from L (FlashAttention-2, Algorithms 1 and 2)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, sm_scale: float):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        kernels, cfg, precision = _setup(q)
        batch, heads, seq_len, head_dim = q.shape
        o = torch.empty_like(q)
        lse = torch.empty(batch * heads, seq_len, device=q.device, dtype=torch.float32)
        grid = (kernels.triton.cdiv(seq_len, cfg.fwd_m), batch * heads)
        kernels.fwd[grid](q, k, v, o, lse, seq_len, sm_scale, CAUSAL=causal, HEAD_DIM=head_dim,
                          BLOCK_M=cfg.fwd_m, BLOCK_N=cfg.fwd_n, DOT_PRECISION=precision,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale, ctx.setup = causal, sm_scale, (kernels, cfg, precision)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        kernels, cfg, precision = ctx.setup
        batch, heads, seq_len, head_dim = q.shape
        cdiv, bh = kernels.triton.cdiv, batch * heads
        delta = torch.empty_like(lse)
        kernels.bwd_delta[(cdiv(seq_len, cfg.dq_m), bh)](o, do, delta, seq_len, HEAD_DIM=head_dim, BLOCK_M=cfg.dq_m)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        common = dict(CAUSAL=ctx.causal, HEAD_DIM=head_dim, DOT_PRECISION=precision,
                      num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        kernels.bwd_dkdv[(cdiv(seq_len, cfg.dkdv_n), bh)](q, k, v, do, lse, delta, dk, dv, seq_len, ctx.sm_scale,
                                                         BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, **common)
        kernels.bwd_dq[(cdiv(seq_len, cfg.dq_m), bh)](q, k, v, do, lse, delta, dq, seq_len, ctx.sm_scale,
                                                     BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, **common)
        return dq, dk, dv, None, None


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim) [+ causal mask]) v with the FlashAttention-2 kernels above; differentiable.

    q, k, v: (batch, heads, seq, head_dim), same shape, dtype and device. Causal: query i sees keys j <= i,
    as `F.scaled_dot_product_attention(is_causal=True)`. tl.dot wants power-of-two tiles of at least 16, so
    head_dim is zero-padded up to one here (zeros change neither q k^T nor the output's real columns).
    """
    if not (q.dim() == 4 and q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must share one (batch, heads, seq, head_dim) shape, got {q.shape, k.shape, v.shape}")
    if not (q.dtype == k.dtype == v.dtype and q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and device")
    head_dim = q.shape[-1]
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported")
    reason = triton_unavailable_reason(q.device, q.dtype)
    if reason == _NOT_INSTALLED:
        require("triton", "flash_attention_triton")
    if reason is not None:
        raise RuntimeError(f"flash_attention_triton cannot run here: {reason}")
    padded = max(16, 1 << (head_dim - 1).bit_length())
    if padded != head_dim:
        q, k, v = (F.pad(t, (0, padded - head_dim)) for t in (q, k, v))
    return _FlashAttention.apply(q, k, v, causal, head_dim**-0.5)[..., :head_dim]
