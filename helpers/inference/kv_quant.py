"""An int8 KV cache: keys and values stored as int8, with one float32 scale per token and key/value head.

Decoding reads the whole cache at every step, and at long contexts or large batches the cache, not the weights,
fills the memory: storing it in int8 holds about twice the tokens of bf16 and four times those of fp32 in the
same bytes. Each head's vector of head_dim numbers at one position gets its own symmetric absmax scale, fixed
when the token is written (a per-channel scale, as KIVI uses for keys, would change as tokens arrive). Every cache
hands attention the int8 numbers and their scales the same way (`cached_attention.KVRead`); most kernels read them
dequantized back to the compute dtype, a separate step before attention, while a compiled decode step
(`helpers.model.attention.decode_attention`) puts the scales on the scores and weights instead and reads the int8
numbers once.
"""

from __future__ import annotations

import torch

from ..model.config import GPTConfig

SCALE_DTYPE = torch.float32


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., head_dim) -> int8 values of the same shape and float32 scales (..., 1), x ≈ values * scales.
    Rounding to nearest makes the error at most half a step: |x - values * scale| <= scale / 2."""
    x = x.to(SCALE_DTYPE)
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(torch.finfo(SCALE_DTYPE).tiny)  # an all-zero row
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8), scale


def dequantize_kv(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values * scales in `dtype`, multiplied in float32 or wider (float64 stays exact)."""
    return (values.to(torch.promote_types(dtype, scales.dtype)) * scales).to(dtype)


def kv_bytes_per_token_int8(config: GPTConfig) -> int:
    """Bytes one token adds to an int8 cache: int8 keys and values plus a scale each per key/value head per layer."""
    per_head = config.head_dim + torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * config.n_layers * config.kv_heads * per_head
