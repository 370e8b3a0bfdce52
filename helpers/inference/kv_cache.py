"""Generation with a KV cache: keep every layer's keys and values, so each new token costs one position.

Without a cache, `GPT.generate` runs the whole sequence through the model for every new token, although
the keys and values of the earlier positions do not change (attention is causal: position i only sees
positions <= i). With a cache, a *prefill* pass computes and stores them for the prompt, then each
*decode* step feeds only the newest token, appends its key and value, and attends over the stored ones.

The cache is an object the model's attention layers read and write: `model(idx, cache=cache)` runs the GPT's own
forward pass on the new tokens, with the model's attention backend (one that can attend over a cache: eager, sdpa,
sdpa_mask, or one with its own cached kernel) and any module swapped into it (a quantized Linear, for instance).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.config import GPTConfig
from ..model.decoding import GREEDY, Sampling, check_context, check_decoding, check_prompt
from ..model.gpt import GPT
from .cached_attention import KVRead, KVStorage
from .kv_format import KVFormat, as_kv_format


def kv_cache_bytes_per_token(config: GPTConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one token adds to the cache: a key and a value per key/value head (n_kv_heads x head_dim numbers; d_model
    for GPT-2) in each layer. Grouped-query attention shrinks it by n_heads / n_kv_heads."""
    width = config.kv_heads * config.head_dim
    return 2 * config.n_layers * width * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Pre-allocated keys and values for `max_len` positions, one (batch, kv_heads, max_len, head_dim) pair per layer.

    Allocating once and writing in place avoids re-copying the whole cache at every step, as `torch.cat` would.
    `length` counts the positions filled so far; the prompts of a batch have equal lengths. With
    `kv_format="int8"` keys and values are stored as int8 with a float32 scale per position and head
    (`helpers.inference.kv_format`), and read back in `dtype`.
    """

    def __init__(
        self,
        config: GPTConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_format: str | KVFormat = "auto",
    ) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be at least 1, got batch={batch}, max_len={max_len}")
        if max_len > config.context_length:
            raise ValueError(
                f"max_len {max_len} exceeds the context length {config.context_length}: the position "
                "embeddings stop there"
            )
        self.kv_format = as_kv_format(kv_format)
        self.storage = KVStorage(config.n_layers, (batch, config.kv_heads, max_len, config.head_dim), dtype, device,
                                 self.kv_format)
        self.keys, self.values = self.storage.keys, self.storage.values  # per layer: (batch, heads, max_len, head_dim)
        self.batch, self.max_len, self.length, self.dtype = batch, max_len, 0, dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors (allocated for max_len positions, filled or not), scales included."""
        return self.storage.nbytes

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        if self.length + seq > self.max_len:
            raise ValueError(f"the cache has room for {self.max_len} positions; {self.length} are used, {seq} more "
                             "do not fit")
        return torch.arange(self.length, self.length + seq, device=device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[KVRead]:
        """Write the new positions' keys and values of `layer`; the queries read positions 0 .. length + new - 1,
        query i (at absolute position length + i) up to its own."""
        if k.size(0) != self.batch:
            raise ValueError(f"the cache holds {self.batch} sequences but the input has {k.size(0)}")
        start, end = self.length, self.length + k.size(2)
        self.storage.write(layer, (slice(None), slice(None), slice(start, end)), k, v)
        return [self.storage.at(layer, slice(0, end), start=start)]

    def advance(self, seq: int) -> None:
        self.length += seq

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (speculative decoding rolls back the draft tokens the target
        rejected); their slots are overwritten by the next tokens."""
        if not 0 <= length <= self.length:
            raise ValueError(f"can truncate the cache to 0 .. {self.length} positions, not {length}")
        self.length = length


@torch.no_grad()
def generate_with_cache(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    *,
    kv_cache_dtype: str | KVFormat = "auto",
) -> torch.Tensor:
    """`GPT.generate` with a KV cache: prefill the prompts (batch, seq) of equal length, then one token per step,
    each picked by `sampling` (greedy by default).

    Returns the prompts with `max_new_tokens` tokens appended, the same tokens `GPT.generate` picks
    (up to floating-point ties: a one-token step and a whole-sequence forward round differently).
    `kv_cache_dtype="int8"` stores the cache in int8 (`helpers.inference.kv_format`): an approximation.
    """
    stored_as = as_kv_format(kv_cache_dtype)
    cached = check_cache_room(model, idx, max_new_tokens, sampling)
    was_training = model.training
    model.eval()
    try:
        dtype = model.ln_f.weight.dtype  # the activations' dtype (quantization leaves the norms alone)
        cache = KVCache(model.config, idx.size(0), cached, dtype, idx.device, kv_format=stored_as)
        last = torch.tensor([-1], device=idx.device)
        logits = model(idx, cache=cache, logits_at=last)[:, -1]  # prefill
        return decode_loop(logits, lambda token: model(token, cache=cache)[:, -1], idx, max_new_tokens, sampling,
                           generator)
    finally:
        model.train(was_training)


def check_cache_room(model: GPT, idx: torch.Tensor, max_new_tokens: int, sampling: Sampling) -> int:
    """The positions a cache needs for these prompts and `max_new_tokens`, after checking the prompts, the decoding
    arguments and that they fit the model's context (a cache cannot slide)."""
    check_prompt(idx, model.config.vocab_size)
    check_decoding(max_new_tokens, sampling, model.config.vocab_size)
    return check_context(idx.size(1), max_new_tokens, model.config.context_length)


def decode_loop(logits: torch.Tensor, decode: Callable[[torch.Tensor], torch.Tensor], idx: torch.Tensor,
                max_new_tokens: int, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Pick a token from `logits` (batch, vocab), feed it to `decode` (the next step's logits), `max_new_tokens`
    times; the prompts `idx` with the new tokens appended. The last token is returned, never fed back."""
    tokens = [idx]
    for step in range(max_new_tokens):
        context = torch.cat(tokens, dim=1) if sampling.penalises else None
        tokens.append(sampling.next_token(logits, context, generator))
        if step < max_new_tokens - 1:
            logits = decode(tokens[-1])
    return torch.cat(tokens, dim=1)
