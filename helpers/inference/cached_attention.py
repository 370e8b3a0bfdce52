"""What every KV cache does inside an attention layer, whatever its layout (contiguous per sequence in
`kv_cache.KVCache`, blocks in `paged_kv.PagedKVCache`): store the new positions' keys and values, in the compute
dtype or in int8 with a scale per position and head (`kv_quant`), read them back in the compute dtype, and attend
the new queries over every cached position with the causal rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kv_quant import SCALE_DTYPE, dequantize_kv, quantize_kv


class KVStorage:
    """One keys tensor and one values tensor of `shape` (..., head_dim) per layer; with `int8`, int8 numbers and a
    float32 scale of shape (..., 1) beside each. A cache says where its positions live with an index (`where`):
    a tuple of slices for the contiguous cache, a tensor of flat slots for the paged one."""

    def __init__(self, n_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 int8: bool = False) -> None:
        stored = torch.int8 if int8 else dtype
        self.keys = [torch.zeros(shape, dtype=stored, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=stored, device=device) for _ in range(n_layers)]
        scale_shape = (*shape[:-1], 1)
        self.key_scales = [torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device) for _ in range(n_layers)] \
            if int8 else []
        self.value_scales = [torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device) for _ in range(n_layers)] \
            if int8 else []
        self.dtype, self.int8, self.device = dtype, int8, torch.device(device)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held (filled or not), scales included."""
        tensors = (*self.keys, *self.values, *self.key_scales, *self.value_scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, where: object, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k and v at `where` of `layer`: quantized first in an int8 storage (each position's scale is fixed
        when it is written)."""
        if self.int8:
            k, self.key_scales[layer][where] = quantize_kv(k)
            v, self.value_scales[layer][where] = quantize_kv(v)
        self.keys[layer][where] = k
        self.values[layer][where] = v

    def copy(self, source: object, destination: object) -> None:
        """Every layer's keys and values (and scales) at `source` copied to `destination` (copy-on-write)."""
        for tensor in (*self.keys, *self.values, *self.key_scales, *self.value_scales):
            tensor[destination] = tensor[source]

    def read(self, layer: int, where: object, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `layer` at `where`, in `dtype` (default: the storage's compute dtype)."""
        k, v = self.keys[layer][where], self.values[layer][where]
        if self.int8:
            dtype = dtype or self.dtype
            k = dequantize_kv(k, self.key_scales[layer][where], dtype)
            v = dequantize_kv(v, self.value_scales[layer][where], dtype)
        return k, v


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                  kernel: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Causal attention of new queries over a sequence's cached keys: q (batch, heads, n, head_dim) holds positions
    start..start+n-1, k and v (batch, heads, start+n, head_dim) positions 0..start+n-1; query i sees keys
    0..start+i. One new token sees every key (no mask), a whole prompt the usual causal mask (so SDPA may pick its
    fastest kernel), a chunk after cached positions an offset mask. `kernel`: a masked attention kernel of
    `helpers.model.attention` (the model's own)."""
    n = q.size(2)
    if n == 1:
        return kernel(q, k, v, is_causal=False)
    if start == 0:
        return kernel(q, k, v, is_causal=True)
    allowed = torch.ones(n, start + n, dtype=torch.bool, device=q.device).tril(diagonal=start)
    return kernel(q, k, v, attn_mask=allowed, is_causal=False)
