"""FlashAttention in pure PyTorch: the tested version of what the FlashAttention notebook teaches.

Eager attention builds the whole (seq x seq) score matrix, so its memory grows as seq^2. FlashAttention
(Dao et al., 2022; FlashAttention-2, Dao, 2023) computes exactly the same result one tile at a time:
a block of queries meets a block of keys/values, and the *online softmax* (a running row max m and
row sum l, rescaling what has been accumulated whenever m grows) means no row ever needs all of its
scores at once. Backward stores no attention matrix either: it keeps only the per-row log-sum-exp
(lse) and *recomputes* each tile of probabilities from Q, K and lse.

A GPU kernel keeps each tile in on-chip SRAM; here a tile is an ordinary tensor of shape
(batch, heads, block_q, block_k) and the loops over blocks are Python loops, so this is for reading,
testing and counting work, not for speed. Shapes follow `F.scaled_dot_product_attention`:
q is (batch, heads, seq_q, head_dim), k and v are (batch, heads, seq_k, head_dim), and causal means
query i attends to keys j <= i (`is_causal=True`).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size_q: int, block_size_k: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-d tensor (batch, heads, seq, head_dim), got {got}")
    if not q.dtype.is_floating_point or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one floating-point dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them with .to()")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"k and v must have the same shape and share batch, heads and head_dim with q, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-2] == 0 or k.shape[-2] == 0 or q.shape[-1] == 0:
        raise ValueError(f"seq and head_dim must be at least 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    for name, size in (("block_size_q", block_size_q), ("block_size_k", block_size_k)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def _future_mask(q_start: int, q_end: int, k_start: int, k_end: int, device: torch.device) -> torch.Tensor:
    """(block_q, block_k) bool tile: True where key j lies in the future of query i (j > i)."""
    rows = torch.arange(q_start, q_end, device=device)
    cols = torch.arange(k_start, k_end, device=device)
    return cols[None, :] > rows[:, None]


def _score_tile(q_i, k_j, scale, causal, q_start, q_end, k_start, k_end):
    """S_ij = Q_i K_j^T * scale, with future keys set to -inf; only tiles crossing the diagonal need the mask."""
    s = (q_i @ k_j.transpose(-2, -1)) * scale
    if causal and k_end - 1 > q_start:
        s = s.masked_fill(_future_mask(q_start, q_end, k_start, k_end, s.device), float("-inf"))
    return s


class FlashAttentionTorch(torch.autograd.Function):
    """softmax(Q K^T / sqrt(head_dim) [+ causal mask]) V by tiles, with a recomputing backward.

    Apply as `FlashAttentionTorch.apply(q, k, v, causal, block_size_q, block_size_k)`.
    Tiles are upcast to float32 (float64 stays float64) as a kernel upcasts them in SRAM, so fp16/bf16
    inputs get float32 accumulators, m, l and lse; outputs and gradients come back in the input dtype.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, block_size_q: int, block_size_k: int):
        _check_inputs(q, k, v, block_size_q, block_size_k)
        batch, heads, seq_q, head_dim = q.shape
        seq_k = k.shape[-2]
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(head_dim)
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(batch, heads, seq_q, dtype=acc_dtype, device=q.device)

        for q_start in range(0, seq_q, block_size_q):
            q_end = min(q_start + block_size_q, seq_q)
            q_i = q[:, :, q_start:q_end].to(acc_dtype)
            # Running row max m_i, row sum l_i and unnormalised output o_i, in the papers' names.
            m_i = torch.full((batch, heads, q_end - q_start), float("-inf"), dtype=acc_dtype, device=q.device)
            l_i = torch.zeros_like(m_i)
            o_i = torch.zeros(batch, heads, q_end - q_start, head_dim, dtype=acc_dtype, device=q.device)
            # Causal: key blocks starting at or after q_end lie entirely in this block's future; skip them.
            k_stop = min(seq_k, q_end) if causal else seq_k
            for k_start in range(0, k_stop, block_size_k):
                k_end = min(k_start + block_size_k, seq_k)
                k_j = k[:, :, k_start:k_end].to(acc_dtype)
                v_j = v[:, :, k_start:k_end].to(acc_dtype)
                s = _score_tile(q_i, k_j, scale, causal, q_start, q_end, k_start, k_end)
                # Online softmax. The first key block holds key 0, which every query sees, so m_i is finite
                # from then on and exp(-inf - m_i) = 0 cleanly drops masked scores and the -inf start.
                m_new = torch.maximum(m_i, s.amax(dim=-1))
                p = torch.exp(s - m_new[..., None])
                correction = torch.exp(m_i - m_new)  # rescales what was summed under the old, smaller max
                l_i = correction * l_i + p.sum(dim=-1)
                o_i = correction[..., None] * o_i + p @ v_j
                m_i = m_new
            o[:, :, q_start:q_end] = (o_i / l_i[..., None]).to(q.dtype)  # normalise once, at the end
            lse[:, :, q_start:q_end] = m_i + torch.log(l_i)

        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.block_size_q, ctx.block_size_k = causal, block_size_q, block_size_k
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o):
        """FlashAttention-2 backward: outer loop over key blocks (dK_j, dV_j stay local), inner over query blocks.

        P_ij = exp(S_ij - lse_i) is recomputed instead of stored, and delta_i = rowsum(dO_i * O_i) equals
        rowsum(P_ij * dP_ij) over all j, which is what the softmax backward dS = P * (dP - delta) needs.
        """
        q, k, v, o, lse = ctx.saved_tensors
        causal, block_size_q, block_size_k = ctx.causal, ctx.block_size_q, ctx.block_size_k
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        seq_q, head_dim = q.shape[-2:]
        seq_k = k.shape[-2]
        acc_dtype = lse.dtype
        scale = 1.0 / math.sqrt(head_dim)
        delta = (grad_o.to(acc_dtype) * o.to(acc_dtype)).sum(dim=-1)
        dq = torch.zeros_like(q, dtype=acc_dtype, memory_format=torch.contiguous_format) if need_dq else None
        dk = torch.empty_like(k, memory_format=torch.contiguous_format) if need_dk else None
        dv = torch.empty_like(v, memory_format=torch.contiguous_format) if need_dv else None

        for k_start in range(0, seq_k, block_size_k):
            k_end = min(k_start + block_size_k, seq_k)
            k_j = k[:, :, k_start:k_end].to(acc_dtype)
            v_j = v[:, :, k_start:k_end].to(acc_dtype)
            dk_j = torch.zeros_like(k_j)
            dv_j = torch.zeros_like(v_j)
            # Causal: query blocks ending before k_start see none of these keys; start at the block holding k_start.
            first_q = (k_start // block_size_q) * block_size_q if causal else 0
            for q_start in range(first_q, seq_q, block_size_q):
                q_end = min(q_start + block_size_q, seq_q)
                q_i = q[:, :, q_start:q_end].to(acc_dtype)
                do_i = grad_o[:, :, q_start:q_end].to(acc_dtype)
                s = _score_tile(q_i, k_j, scale, causal, q_start, q_end, k_start, k_end)
                p = torch.exp(s - lse[:, :, q_start:q_end, None])  # recomputation: masked scores give p = 0
                if need_dv:
                    dv_j += p.transpose(-2, -1) @ do_i
                if need_dq or need_dk:
                    dp = do_i @ v_j.transpose(-2, -1)
                    ds = p * (dp - delta[:, :, q_start:q_end, None])
                    if need_dq:
                        dq[:, :, q_start:q_end] += scale * (ds @ k_j)
                    if need_dk:
                        dk_j += scale * (ds.transpose(-2, -1) @ q_i)
            if need_dk:
                dk[:, :, k_start:k_end] = dk_j.to(k.dtype)
            if need_dv:
                dv[:, :, k_start:k_end] = dv_j.to(v.dtype)

        dq = dq.to(q.dtype) if need_dq else None
        return dq, dk, dv, None, None, None


def flash_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    block_size_q: int = 64,
    block_size_k: int = 64,
) -> torch.Tensor:
    """Exact attention computed tile by tile, never materialising a (seq x seq) matrix; see the module docstring.

    q: (batch, heads, seq_q, head_dim); k, v: (batch, heads, seq_k, head_dim); same dtype and device.
    Returns (batch, heads, seq_q, head_dim) in the input dtype. Softmax scale is 1/sqrt(head_dim).
    Causal keeps keys j <= i; when seq_q != seq_k that is SDPA's top-left alignment (the flash-attn
    package aligns bottom-right instead).
    """
    return FlashAttentionTorch.apply(q, k, v, causal, block_size_q, block_size_k)
