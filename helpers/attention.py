"""Causal multi-head self-attention with interchangeable kernels.

Every kernel takes q, k, v shaped (batch, heads, seq, head_dim) and returns the same shape, so
the same weights can run under each one (`GPT(..., attn_implementation=name)`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """Textbook attention: materialises the (seq x seq) score matrix, so memory grows as T^2."""
    seq = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """PyTorch's fused kernel; `is_causal=True` (no explicit mask) lets it pick FlashAttention."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


ATTENTION_KERNELS = {"eager": eager_attention, "sdpa": sdpa_attention}


def check_attn_implementation(name: str) -> str:
    if name not in ATTENTION_KERNELS:
        raise ValueError(
            f"unknown attn_implementation {name!r}; valid names: {', '.join(ATTENTION_KERNELS)}"
        )
    return name


class CausalSelfAttention(nn.Module):
    """GPT-2 attention: one fused QKV projection, a kernel over all heads, an output projection."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.attn_dropout = dropout  # on the attention weights, inside the kernel
        self.attn_implementation = check_attn_implementation(attn_implementation)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        # (batch, seq, d_model) -> (batch, heads, seq, head_dim)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        kernel = ATTENTION_KERNELS[self.attn_implementation]
        y = kernel(q, k, v, dropout_p=self.attn_dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, d_model)
        return self.resid_dropout(self.out_proj(y))
