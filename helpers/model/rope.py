"""Rotary position embeddings (RoPE; Su et al. 2021, used by LLaMA, Qwen, Mistral, Gemma).

Instead of adding a learned position vector to the token embedding, RoPE rotates each head's query and key: the
pair of dimensions (i, i + head_dim/2) of position p turns by the angle p·θ^(-2i/head_dim). A rotation by a
and one by b leave a dot product that depends on b - a only, so q_m·k_n depends on the tokens and on m - n: the
attention scores see relative positions, and nothing is learned.

Pairs are (i, i + head_dim/2), the "rotate half" layout of Hugging Face's LLaMA and Qwen3 (the original pairs
neighbours (2i, 2i+1); the two differ by a fixed permutation of the projection's rows), so their weights load
unchanged.
"""

from __future__ import annotations

import torch


def rope_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """The head_dim/2 angular frequencies θ^(-2i/head_dim), i = 0 .. head_dim/2 - 1: fast pairs first."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, (seq, head_dim): each frequency twice (both halves of a pair).

    Computed in float32 from the positions each call (a few thousand numbers), so no buffer has to follow the
    model between devices or survive loading on the meta device.
    """
    angles = positions.to(torch.float32)[:, None] * rope_frequencies(head_dim, theta, positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a quarter turn of every pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., seq, head_dim) by the angles of its positions: x·cos + rotate_half(x)·sin, in x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
