"""Generation with a KV cache: keep every layer's keys and values, so each new token costs one position.

Without a cache, `GPT.generate` runs the whole sequence through the model for every new token, although
the keys and values of the earlier positions do not change (attention is causal: position i only sees
positions <= i). With a cache, a *prefill* pass computes and stores them for the prompt, then each
*decode* step feeds only the newest token, appends its key and value, and attends over the stored ones.

The cached forward reuses the GPT's own submodules (embeddings, LayerNorms, QKV and output projections,
feed-forward, LM head), so any module swapped into the model (a quantized Linear, for instance) is used
as is. Attention itself always runs through `F.scaled_dot_product_attention`, whatever kernel the model
was set to: the query length (1 when decoding) differs from the key length, which the causal kernels of
`helpers.attention` do not handle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import GPTConfig
from .model import GPT, cached_positions, check_decoding, check_prompt, sample_next_token


def kv_cache_bytes_per_token(config: GPTConfig, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one token adds to the cache: a key and a value of d_model numbers in each layer."""
    return 2 * config.n_layers * config.d_model * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """Pre-allocated keys and values for `max_len` positions, one (batch, heads, max_len, head_dim) pair per layer.

    Allocating once and writing in place avoids re-copying the whole cache at every step, as `torch.cat` would.
    `length` counts the positions filled so far.
    """

    def __init__(
        self,
        config: GPTConfig,
        batch: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be at least 1, got batch={batch}, max_len={max_len}")
        if max_len > config.context_length:
            raise ValueError(
                f"max_len {max_len} exceeds the context length {config.context_length}: the position "
                "embeddings stop there"
            )
        shape = (batch, config.n_heads, max_len, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.batch, self.max_len, self.length = batch, max_len, 0

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache tensors (allocated for max_len positions, filled or not)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the keys/values of the new positions of `layer`; return that layer's keys/values so far."""
        end = self.length + k.size(2)
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def forward_cached(model: GPT, idx: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
    """Run the new tokens `idx` (batch, seq) at positions cache.length, ..., appending their keys and values.

    Returns the logits of the last position (batch, vocab), or of every new position (batch, seq, vocab)
    with `all_logits` (the LM head over the whole prompt is wasted work when only the next token is needed).
    """
    batch, seq = idx.shape
    start = cache.length
    if batch != cache.batch:
        raise ValueError(f"the cache holds {cache.batch} sequences but idx has {batch}")
    if start + seq > cache.max_len:
        raise ValueError(f"the cache has room for {cache.max_len} positions; {start} are used, {seq} more do not fit")
    if model.training and model.config.dropout > 0:
        raise ValueError("the cached forward is for inference: call model.eval() first (dropout is on)")
    c = model.config
    pos = torch.arange(start, start + seq, device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    # Query i (absolute position start + i) may see keys 0 .. start + i: every stored key when seq == 1, the
    # usual causal mask when the cache was empty (is_causal lets SDPA pick its fastest kernel), else an offset mask.
    mask, is_causal = None, seq > 1 and start == 0
    if seq > 1 and start > 0:
        mask = torch.ones(seq, start + seq, dtype=torch.bool, device=idx.device).tril(diagonal=start)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = (t.view(batch, seq, c.n_heads, c.head_dim).transpose(1, 2)
                   for t in attn.qkv(block.ln1(x)).split(c.d_model, dim=-1))
        keys, values = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal)
        x = x + attn.resid_dropout(attn.out_proj(y.transpose(1, 2).reshape(batch, seq, c.d_model)))
        x = x + block.mlp(block.ln2(x))
    cache.length += seq
    if not all_logits:
        x = x[:, -1]
    return model.lm_head(model.ln_f(x))


@torch.no_grad()
def generate_with_cache(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`GPT.generate` with a KV cache: prefill the prompts (batch, seq) of equal length, then one token per step.

    Returns the prompts with `max_new_tokens` tokens appended, the same tokens `GPT.generate` picks
    (up to floating-point ties: a one-token step and a whole-sequence forward round differently).
    """
    check_prompt(idx, model.config.vocab_size)
    check_decoding(max_new_tokens, temperature, top_k, model.config.vocab_size)
    ctx, cached = model.config.context_length, cached_positions(idx.size(1), max_new_tokens)
    if idx.size(1) > ctx:
        raise ValueError(f"the prompt has {idx.size(1)} tokens but the context length is {ctx}; shorten it (e.g. "
                         f"keep its last {ctx - max_new_tokens + 1} tokens to generate {max_new_tokens})")
    if cached > ctx:
        raise ValueError(
            f"a prompt of {idx.size(1)} tokens plus {max_new_tokens} new tokens needs {cached} cached positions "
            f"(the last new token is never fed back) but the context length is {ctx}. A KV cache cannot slide like "
            "GPT.generate's window: the positions of every kept token would change, so all their keys and values "
            f"would have to be recomputed. Set max_new_tokens to {ctx - idx.size(1) + 1} or less, shorten the "
            "prompt, or use GPT.generate (no cache, sliding window)"
        )
    was_training = model.training
    model.eval()
    try:
        dtype = model.pos_emb.weight.dtype  # the activations' dtype (quantization leaves this embedding alone)
        cache = KVCache(model.config, idx.size(0), cached, dtype, idx.device)
        logits = forward_cached(model, idx, cache)  # prefill
        tokens = [idx]
        for step in range(max_new_tokens):
            tokens.append(sample_next_token(logits, temperature, top_k, generator))
            if step < max_new_tokens - 1:  # the last token is returned, never fed back
                logits = forward_cached(model, tokens[-1], cache)  # decode
    finally:
        model.train(was_training)
    return torch.cat(tokens, dim=1)
