"""The rules every decoder shares (GPT.generate, the KV-cache generator, the serving engine): which token ids a model
accepts, which decoding arguments are valid, how many positions a cache needs, and how the next token is picked."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_token_ids(idx: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError naming the first token id outside [0, vocab_size): the embedding lookup would fail with
    "index out of range in self" on CPU and a device-side assert (which poisons the CUDA context) on a GPU.
    One min/max reduction; on an accelerator it waits for the ids to be ready (a host sync). Skipped where the
    values cannot be read: fake tensors (FLOP counting), tracing and torch.compile."""
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(f"token ids must be integers, got a {idx.dtype} tensor; convert with .long()")
    readable = type(idx) is torch.Tensor  # FakeTensor (and DTensor) are subclasses
    if not readable or idx.numel() == 0 or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return
    low, high = (int(v) for v in torch.aminmax(idx))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        where = tuple(int(i) for i in (idx == bad).nonzero()[0])
        raise ValueError(f"token id {bad} at index {where} is outside the vocabulary [0, {vocab_size}); ids must "
                         "come from the tokenizer the model was built for (check vocab_size in its GPTConfig)")


def check_decoding(max_new_tokens: int, temperature: float, top_k: int | None, vocab_size: int) -> None:
    """The arguments every decoder (GPT.generate, the KV-cache generator, the serving engine) accepts."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be an integer in [1, {vocab_size}] or None, got {top_k!r}")


def cached_positions(prompt_len: int, max_new_tokens: int) -> int:
    """Positions a KV cache must hold to generate `max_new_tokens` after a prompt: the last new token is returned,
    never fed back, so it needs no keys or values. The one rule of every cached decoder."""
    return prompt_len + max_new_tokens - 1


def check_prompt(idx: object, vocab_size: int) -> None:
    """A batch of equal-length prompts: an integer tensor (batch, seq) with seq >= 1 and ids in the vocabulary."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"expected the prompts as a tensor of token ids (batch, seq), got {type(idx).__name__}; "
                        "stack prompts of equal length with torch.tensor([...]), or serve prompts of different "
                        "lengths with helpers.inference.serving.Engine")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"expected a prompt of shape (batch, seq) with seq >= 1, got shape {tuple(idx.shape)}")
    check_token_ids(idx, vocab_size)


def sample_next_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> torch.Tensor:
    """Next token ids (batch, 1) from last-position logits (batch, vocab): greedy at temperature 0, else
    softmax(logits / temperature) over the top_k most likely tokens. Every decoder (with or without a KV cache)
    uses this one rule, so the same generator state draws the same tokens."""
    logits = logits.float()
    if temperature == 0.0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
