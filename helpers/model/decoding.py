"""The rules every decoder shares (GPT.generate, the KV-cache generator, the serving engine): which token ids a model
accepts, which decoding arguments are valid, how many positions a cache needs, and how the next token is picked."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def check_decoding(max_new_tokens: int, sampling: Sampling, vocab_size: int) -> None:
    """The arguments every decoder (GPT.generate, the KV-cache generator, speculative decoding, the serving engine)
    accepts."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a helpers.model.decoding.Sampling, e.g. Sampling(temperature=0.8, "
                        f"top_k=40) (GREEDY: argmax), got {sampling!r}")
    sampling.check(vocab_size)


def cached_positions(prompt_len: int, max_new_tokens: int) -> int:
    """Positions a KV cache must hold to generate `max_new_tokens` after a prompt: the last new token is returned,
    never fed back, so it needs no keys or values. The one rule of every cached decoder."""
    return prompt_len + max_new_tokens - 1


class ContextExceeded(ValueError):
    """A request that does not fit the model's context; carries its numbers, so a caller can say it in its own words
    (the serving engine names `max_tokens`)."""

    def __init__(self, message: str, prompt_len: int, positions: int, context_length: int):
        super().__init__(message)
        self.prompt_len, self.positions, self.context_length = prompt_len, positions, context_length

    @property
    def prompt_too_long(self) -> bool:
        return self.prompt_len > self.context_length


def check_context(prompt_len: int, max_new_tokens: int, context_length: int) -> int:
    """The positions a decoder feeds the model (`cached_positions`) for this request, after checking they fit its
    context: a prompt plus new tokens may reach context + 1 tokens, never more. The one context rule of every decoder
    that does not slide (the KV-cache generators, the serving engine, speculative decoding, beam search), so each
    accepts or refuses the same request the same way; raises ContextExceeded."""
    cached = cached_positions(prompt_len, max_new_tokens)
    numbers = (prompt_len, cached, context_length)
    if prompt_len > context_length:
        raise ContextExceeded(f"the prompt has {prompt_len} tokens but the context length is {context_length}; "
                              f"shorten it (e.g. keep its last {context_length - max_new_tokens + 1} tokens to "
                              f"generate {max_new_tokens})", *numbers)
    if cached > context_length:
        raise ContextExceeded(
            f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens needs {cached} cached positions "
            f"(the last new token is never fed back) but the context length is {context_length}. A KV cache cannot "
            "slide like GPT.generate's window: the positions of every kept token would change, so all their keys and "
            f"values would have to be recomputed. Set max_new_tokens to {context_length - prompt_len + 1} or less, "
            "shorten the prompt, or use GPT.generate (no cache, sliding window)", *numbers)
    return cached


def check_prompt(idx: object, vocab_size: int) -> None:
    """A batch of equal-length prompts: an integer tensor (batch, seq) with seq >= 1 and ids in the vocabulary."""
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"expected the prompts as a tensor of token ids (batch, seq), got {type(idx).__name__}; "
                        "stack prompts of equal length with torch.tensor([...]), or serve prompts of different "
                        "lengths with helpers.inference.serving.Engine")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"expected a prompt of shape (batch, seq) with seq >= 1, got shape {tuple(idx.shape)}")
    check_token_ids(idx, vocab_size)


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the model's logits: the one rule of every decoder, so the same generator
    state draws the same tokens with or without a KV cache.

    In order, as transformers' logits processors apply them:
    - repetition_penalty (CTRL, Keskar et al. 2019): each token already in the context has its logit divided by
      the penalty when positive, multiplied when negative (1: off);
    - frequency_penalty and presence_penalty (OpenAI's API): subtract penalty × count and penalty × [count > 0]
      from each token's logit, counted over the context (0: off);
    - temperature: 0 is greedy (argmax of the penalised logits), else logits / temperature;
    - top_k: keep the k most likely tokens; top_p (nucleus, Holtzman et al. 2019): keep the smallest set of most
      likely tokens whose probabilities add up to at least p.
    The context is every token the decoder holds for that sequence: the prompt and what it generated so far.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def check(self, vocab_size: int) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        k = self.top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab_size):
            raise ValueError(f"top_k must be an integer in [1, {vocab_size}] or None, got {k!r}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number (0 = off), got {getattr(self, name)}")

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: the argmax of the (penalised) logits, no random draw."""
        return self.temperature == 0.0

    @property
    def penalises(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def logits(self, logits: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (batch, vocab) the next token is drawn from, in float32: -inf where a token is excluded.
        `context` (batch, seq) is needed only when a penalty is on. At temperature 0 only the penalties apply."""
        logits = logits.float()
        if self.penalises:
            if context is None:
                raise ValueError("repetition, frequency and presence penalties need the context's token ids")
            counts = torch.zeros_like(logits).scatter_add_(1, context, torch.ones_like(context, dtype=logits.dtype))
            seen = counts > 0
            if self.repetition_penalty != 1.0:
                penalised = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
                logits = torch.where(seen, penalised, logits)
            logits = logits - self.frequency_penalty * counts - self.presence_penalty * seen
        if self.is_greedy:
            return logits
        logits = logits / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ranked, order = logits.sort(dim=-1, descending=True)
            probs = ranked.softmax(dim=-1)
            drop_ranked = probs.cumsum(dim=-1) - probs >= self.top_p  # the more likely ones already reach top_p
            drop = torch.empty_like(drop_ranked).scatter_(1, order, drop_ranked)  # back to vocabulary order
            logits = logits.masked_fill(drop, float("-inf"))
        return logits

    def next_token(self, logits: torch.Tensor, context: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """Next token ids (batch, 1) from last-position logits (batch, vocab)."""
        logits = self.logits(logits, context)
        if self.is_greedy:
            return logits.argmax(dim=-1, keepdim=True)
        return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


GREEDY = Sampling()  # the default of every decoder: the argmax, no penalties


@torch.no_grad()
def beam_search(model: torch.nn.Module, idx: torch.Tensor, max_new_tokens: int, beams: int) -> torch.Tensor:
    """The prompt idx (1, seq) continued by `max_new_tokens` tokens: at every step each of the `beams` kept
    sequences is extended by every token, and the `beams` extensions with the largest summed log-probability of
    their new tokens are kept; returns the best one at the end, (1, seq + max_new_tokens). One beam is greedy
    decoding; enough beams (vocab ** (max_new_tokens - 1)) search every continuation. Recomputes every sequence
    without a cache: a reference, not a server."""
    vocab_size = model.config.vocab_size
    check_prompt(idx, vocab_size)
    check_decoding(max_new_tokens, GREEDY, vocab_size)
    if idx.size(0) != 1:
        raise ValueError(f"beam search here continues one prompt at a time, got a batch of {idx.size(0)}")
    if isinstance(beams, bool) or not isinstance(beams, int) or beams < 1:
        raise ValueError(f"beams must be a positive integer, got {beams!r}")
    check_context(idx.size(1), max_new_tokens, model.config.context_length)  # the longest sequence it feeds
    was_training = model.training
    model.eval()
    try:
        sequences, scores = idx, torch.zeros(1, dtype=torch.float64, device=idx.device)
        for _ in range(max_new_tokens):
            log_probs = F.log_softmax(model(sequences)[:, -1].double(), dim=-1)  # (kept, vocab)
            totals = (scores[:, None] + log_probs).flatten()
            scores, best = totals.topk(min(beams, totals.numel()))  # sorted, largest first
            width = log_probs.size(-1)  # the head's rows: which kept sequence, which token
            sequences = torch.cat([sequences[best // width], (best % width)[:, None]], dim=1)
        return sequences[:1]
    finally:
        model.train(was_training)
