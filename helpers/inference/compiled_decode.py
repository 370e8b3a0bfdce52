"""A compiled decode step: a static KV cache, fixed shapes, one graph for the whole generation.

At batch 1 a decode step is many small operations, each launched from Python and each reading its inputs from
memory; torch.compile traces the step once and replaces them with fewer, fused kernels. It can reuse the traced
graph only while the shapes stay the same, and `kv_cache.KVCache` attends over the `length` positions filled so
far, a shape that grows by one every step. `StaticKVCache` attends over all `max_len` slots at every step and masks
the ones not written yet, with the new token's position passed as a tensor: the step's shapes never change, so one
graph serves every step (gpt-fast's recipe). The prefill runs eagerly: its length changes with the prompt. Attention
is the model's backend's, from the registry, as in every cache; over a static cache a backend attends a decode step
with `decode_attention` (`helpers.model.attention`), two loops over the cache that the compiler writes itself, so an
int8 cache is read as int8, unless it brings a kernel of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.config import GPTConfig
from ..model.decoding import GREEDY, Sampling
from ..model.gpt import GPT
from .cached_attention import KVRead, KVStorage
from .kv_cache import check_cache_room, decode_loop
from .kv_format import KVFormat, as_kv_format


class StaticKVCache:
    """Keys and values for `max_len` positions of `batch` sequences, one (batch, kv_heads, max_len, head_dim) pair per
    layer, preallocated and written in place at the positions `at` names, stored as `kv_format` says (int8 with a
    scale per position and head, as `KVCache(kv_format="int8")` stores them, or the compute dtype).

    The model's attention layers call it as they call `KVCache` (the `KVCacheView` protocol): `at(positions)` says
    where the next tokens go, `update` writes their keys and values there and hands the backend every slot, masked
    up to each query's position. Nothing is read from the cache's length, so compiled code sees no Python number
    change.
    """

    def __init__(self, config: GPTConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", kv_format: str | KVFormat = "auto") -> None:
        if batch < 1 or not 1 <= max_len <= config.context_length:
            raise ValueError(f"need batch >= 1 and 1 <= max_len <= the context length {config.context_length}, got "
                             f"batch={batch}, max_len={max_len}")
        self.kv_format = as_kv_format(kv_format)
        self.storage = KVStorage(config.n_layers, (batch, config.kv_heads, max_len, config.head_dim), dtype, device,
                                 self.kv_format)
        self.slots = torch.arange(max_len, device=device)
        self.batch, self.max_len = batch, max_len
        self.input_pos = self.slots[:1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors, scales included."""
        return self.storage.nbytes

    def at(self, positions: torch.Tensor) -> StaticKVCache:
        """The positions (seq,) of the next forward pass's tokens, the same for every sequence of the batch."""
        self.input_pos = positions
        return self

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        return self.input_pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[KVRead]:
        """Write k, v (batch, kv_heads, seq, head_dim) at the positions; every query reads all the slots, up to its own
        position: a (seq, max_len) mask, so a slot not written yet (or left from a longer earlier generation) is
        never seen. Static: the model's backend attends a decode step with `decode_attention` (an int8 cache read as
        int8) unless it brings its own kernel."""
        if k.size(0) != self.batch:
            raise ValueError(f"the cache holds {self.batch} sequences but the input has {k.size(0)}")
        self.storage.write(layer, (slice(None), slice(None), self.input_pos), k, v)
        allowed = self.slots[None, :] <= self.input_pos[:, None]
        return [self.storage.at(layer, slice(None), allowed=allowed, static=True)]

    def advance(self, seq: int) -> None:
        """Nothing to count: the caller passes every step's positions."""


class CompiledDecoder:
    """A model's decode step over a `StaticKVCache`, compiled once for `batch` sequences of up to `max_len` positions
    and reused across generations (compiling takes seconds, a step milliseconds).

    `kv_cache_dtype="int8"` stores the cache in int8, as `generate_with_cache` does. `compile=False` runs the same
    step eagerly (the reference the compiled one is tested against); `backend` and `mode` go to torch.compile
    (default: inductor; "reduce-overhead" on CUDA, which replays the step as a CUDA graph). The model must be in
    eval mode and stay unchanged: the compiled graph holds its weights.
    """

    def __init__(self, model: GPT, batch: int, max_len: int, *, kv_cache_dtype: str | KVFormat = "auto",
                 compile: bool = True, backend: str | Callable = "inductor", mode: str | None = None) -> None:
        self.model = model.eval()
        device = next(model.parameters()).device
        self.cache = StaticKVCache(model.config, batch, max_len, model.ln_f.weight.dtype, device,
                                   kv_format=kv_cache_dtype)
        if mode is None and device.type == "cuda" and backend == "inductor":
            mode = "reduce-overhead"
        self.step = torch.compile(self.decode, backend=backend, mode=mode, fullgraph=True, dynamic=False) \
            if compile else self.decode

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        """The prompts (batch, seq) into slots 0 .. seq-1, eagerly; the last position's logits (batch, vocab)."""
        positions = self.cache.slots[: idx.size(1)]
        return self.model(idx, cache=self.cache.at(positions), logits_at=positions[-1:])[:, -1]

    def decode(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One new token per sequence (batch, 1) at `position` (a one-element tensor); its logits (batch, vocab).

        no_grad inside, not as a decorator: a decorated method is a torch function to Dynamo, which then compiles
        a wrapper frame and looks the bound method up by its address among Python's builtins, where a Jupyter
        kernel leaves the address of a method it has freed (each cell's `input` is a new bound method)."""
        with torch.no_grad():
            return self.model(tokens, cache=self.cache.at(position))[:, -1]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, sampling: Sampling = GREEDY,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """`generate_with_cache` with the compiled step: the prompts with `max_new_tokens` tokens appended."""
        cached = check_cache_room(self.model, idx, max_new_tokens, sampling)
        if idx.size(0) != self.cache.batch or cached > self.cache.max_len:
            raise ValueError(f"this decoder was built for batch {self.cache.batch} and {self.cache.max_len} positions; "
                             f"these prompts need batch {idx.size(0)} and {cached}: build a CompiledDecoder for them")
        logits = self.prefill(idx)
        position = torch.tensor([idx.size(1)], device=idx.device)

        def decode(token: torch.Tensor) -> torch.Tensor:
            logits = self.step(token, position)
            position.add_(1)  # in place: the compiled step reads the tensor, never a Python number
            return logits

        return decode_loop(logits, decode, idx, max_new_tokens, sampling, generator)
