"""How a KV cache stores keys and values: in the model's compute dtype, or as int8 with a scale per position and
head (`kv_quant`). A user names the format (`kv_cache_dtype="auto"` or `"int8"`); `as_kv_format` turns the name into
a `KVFormat` once, and every cache (contiguous, paged, static) stores and sizes its tensors by asking the format.
A new format (fp8, int4 with group scales) is one subclass and one entry in `KV_FORMATS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..model.config import GPTConfig
from .kv_quant import SCALE_DTYPE, quantize_kv


class KVFormat(ABC):
    """One way of storing a cache's keys and values. `scaled`: a scale of shape (..., 1) is stored beside each
    position and head's numbers, and `KVRead.read` multiplies it back."""

    name: str
    scaled: bool = False

    @abstractmethod
    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the stored numbers for a model computing in `dtype`."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keys or values (..., head_dim) as stored, and their scales (..., 1) (None unless `scaled`)."""

    def bytes_per_token(self, config: GPTConfig, dtype: torch.dtype) -> int:
        """Bytes one token adds: a key and a value per key/value head in each layer, scales included."""
        numbers = config.head_dim * torch.empty((), dtype=self.stored_dtype(dtype)).element_size()
        scale = torch.empty((), dtype=SCALE_DTYPE).element_size() if self.scaled else 0
        return 2 * config.n_layers * config.kv_heads * (numbers + scale)

    def __repr__(self) -> str:
        return f"as_kv_format({self.name!r})"


class ComputeDtypeKV(KVFormat):
    """The model's own dtype: exact, and what attention reads without a conversion."""

    name = "auto"

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


class Int8KV(KVFormat):
    """int8 numbers with a float32 absmax scale per position and head, fixed when the token is written: about half
    of bf16's bytes, a quarter of fp32's, for an error of at most half a step."""

    name = "int8"
    scaled = True

    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.int8

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_kv(x)


KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (ComputeDtypeKV(), Int8KV())}
COMPUTE_DTYPE_KV = KV_FORMATS["auto"]


def as_kv_format(kv_cache_dtype: str | KVFormat) -> KVFormat:
    """The format a name stands for ("auto": the model's dtype; "int8"); a format passes through. Anything else is
    a clear error naming the valid ones."""
    if isinstance(kv_cache_dtype, KVFormat):
        return kv_cache_dtype
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; valid: {', '.join(KV_FORMATS)}")
    return KV_FORMATS[kv_cache_dtype]
