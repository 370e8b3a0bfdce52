"""What generated text is like, in numbers: diversity (distinct-n), repetition (seq-rep-n), how much of it is
words of the training text, and how likely the model itself finds it (its perplexity of its own samples)."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

WORD = re.compile(r"[A-Za-z]+")


def words(text: str) -> list[str]:
    """The runs of letters in a text: `__init__` gives `init`, `don't` gives `don` and `t`."""
    return WORD.findall(text)


def known_word_fraction(text: str, vocabulary: set[str]) -> float:
    """The fraction of a text's words (runs of letters) that occur in `vocabulary` (e.g. `set(words(training
    text))`); NaN for a text without words."""
    found = words(text)
    return sum(w in vocabulary for w in found) / len(found) if found else math.nan


def ngrams(ids: list[int], n: int) -> list[tuple[int, ...]]:
    if n < 1:
        raise ValueError(f"n must be 1 or more, got {n}")
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def distinct_n(samples: list[list[int]], n: int) -> float:
    """Distinct n-grams over all n-grams of all samples (Li et al. 2016): 1 when nothing repeats, within a sample
    or across samples; near 0 when every sample says the same thing."""
    grams = [g for ids in samples for g in ngrams(ids, n)]
    if not grams:
        raise ValueError(f"the samples hold no {n}-gram; generate at least {n} tokens")
    return len(set(grams)) / len(grams)


def repetition_rate(samples: list[list[int]], n: int = 4) -> float:
    """seq-rep-n (Welleck et al. 2019), averaged over samples: the fraction of a sample's n-grams that repeat an
    n-gram earlier in the same sample. Greedy decoding's loops score near 1."""
    rates = []
    for ids in samples:
        grams = ngrams(ids, n)
        if not grams:
            raise ValueError(f"a sample of {len(ids)} tokens holds no {n}-gram; generate at least {n} tokens")
        rates.append(1 - len(set(grams)) / len(grams))
    return sum(rates) / len(rates)


@torch.no_grad()
def self_perplexity(model: nn.Module, sequences: torch.Tensor, prompt_len: int) -> float:
    """exp(mean negative log-likelihood) of the tokens after the prompt in `sequences` (batch, seq), under the
    model's plain softmax (temperature 1, nothing filtered): how surprised the model is by its own samples."""
    if not 1 <= prompt_len < sequences.size(1):
        raise ValueError(f"prompt_len must be in [1, {sequences.size(1) - 1}] for sequences of {sequences.size(1)} "
                         f"tokens, got {prompt_len}")
    was_training = model.training
    model.eval()
    try:
        logits = model(sequences[:, :-1])[:, prompt_len - 1 :]
    finally:
        model.train(was_training)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit logits summed in float32
    return math.exp(F.cross_entropy(logits.flatten(0, 1), sequences[:, prompt_len:].flatten()).item())
