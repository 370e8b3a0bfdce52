"""What every KV cache holds inside an attention layer, whatever its layout (contiguous per sequence in
`kv_cache.KVCache`, blocks in `paged_kv.PagedKVCache`, every slot at once in `compiled_decode.StaticKVCache`): the
new positions' keys and values, stored as a `kv_format.KVFormat` says (the compute dtype, or int8 with a scale
per position and head), and, for each attention call, a `KVRead` that says which of them the queries read and
how. The model's attention backend attends over it (`helpers.model.attention.AttentionBackend.attend`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kv_format import COMPUTE_DTYPE_KV, KVFormat
from .kv_quant import SCALE_DTYPE, dequantize_kv


class KVRead(NamedTuple):
    """One layer's keys and values as one attention call reads them (the `CachedKV` of `helpers.model.attention`,
    where each field is described): the tensors as stored, the positions read (`slots`), and which of them each
    query may see (`start`, `allowed`). Reading is the same for every cache: `stored` picks the positions, `read`
    dequantizes an int8 cache (the one place it is)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    slots: slice | torch.Tensor = slice(None)
    start: int = 0
    allowed: torch.Tensor | None = None
    static: bool = False
    queries: slice | None = None
    one_token_each: bool = False

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Keys, values and scales (None unless int8) at `slots`, as stored, (batch, kv_heads, length, ...): a view
        of a contiguous cache, a gather through a paged cache's slots."""
        tensors = (self.keys, self.values) if self.key_scales is None else \
            (self.keys, self.values, self.key_scales, self.value_scales)
        if isinstance(self.slots, slice):
            picked = [t[:, :, self.slots] for t in tensors]
        else:
            picked = [t[self.slots].transpose(1, 2) for t in tensors]
        return (*picked, None, None) if self.key_scales is None else tuple(picked)

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` in `dtype`, (batch, kv_heads, length, head_dim); int8 dequantized."""
        keys, values, key_scales, value_scales = self.stored()
        if key_scales is not None:
            return dequantize_kv(keys, key_scales, dtype), dequantize_kv(values, value_scales, dtype)
        if keys.dtype != dtype:
            return keys.to(dtype), values.to(dtype)
        return keys, values


class KVStorage:
    """One keys tensor and one values tensor of `shape` (..., head_dim) per layer, stored as `kv_format` says; a
    scaled format (int8) keeps a float32 scale of shape (..., 1) beside each. A cache says where its positions live
    with an index (`where`): a tuple of slices for the contiguous cache, a tensor of flat slots for the paged one."""

    def __init__(self, n_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                 kv_format: KVFormat = COMPUTE_DTYPE_KV) -> None:
        stored = kv_format.stored_dtype(dtype)
        self.keys = [torch.zeros(shape, dtype=stored, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=stored, device=device) for _ in range(n_layers)]
        scales = n_layers if kv_format.scaled else 0
        scale_shape = (*shape[:-1], 1)
        self.key_scales = [torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device) for _ in range(scales)]
        self.value_scales = [torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device) for _ in range(scales)]
        self.dtype, self.kv_format, self.device = dtype, kv_format, torch.device(device)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held (filled or not), scales included."""
        tensors = (*self.keys, *self.values, *self.key_scales, *self.value_scales)
        return sum(t.numel() * t.element_size() for t in tensors)

    def write(self, layer: int, where: object, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k and v at `where` of `layer`, encoded by the format (an int8 position's scale is fixed when it is
        written)."""
        k, key_scales = self.kv_format.encode(k)
        v, value_scales = self.kv_format.encode(v)
        if self.kv_format.scaled:
            self.key_scales[layer][where], self.value_scales[layer][where] = key_scales, value_scales
        self.keys[layer][where] = k
        self.values[layer][where] = v

    def copy(self, source: object, destination: object) -> None:
        """Every layer's keys and values (and scales) at `source` copied to `destination` (copy-on-write)."""
        for tensor in (*self.keys, *self.values, *self.key_scales, *self.value_scales):
            tensor[destination] = tensor[source]

    def at(self, layer: int, slots: slice | torch.Tensor, **how) -> KVRead:
        """What `layer` holds at `slots` (a slice of the position axis, or (batch, length) flat slots), read as `how`
        says (`KVRead`'s other fields)."""
        if self.kv_format.scaled:
            how |= dict(key_scales=self.key_scales[layer], value_scales=self.value_scales[layer])
        return KVRead(self.keys[layer], self.values[layer], slots=slots, **how)
