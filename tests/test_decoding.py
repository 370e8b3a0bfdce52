"""The decoding rule (helpers.model.decoding.Sampling) against transformers' logits processors and a float64
count by hand, and the same rule in every decoder."""

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from helpers import GPT, GPTConfig
from helpers.inference.kv_cache import generate_with_cache
from helpers.measure.text_quality import distinct_n, known_word_fraction, repetition_rate, self_perplexity, words
from helpers.model.decoding import Sampling, beam_search

VOCAB = 101
TINY = GPTConfig(vocab_size=VOCAB, context_length=48, d_model=32, n_heads=4, n_layers=2, dropout=0.0)


def random_case(seed: int, batch: int = 3, seq: int = 17):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, VOCAB, generator=g) * 3
    context = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return logits, context


def transformers_logits(logits, context, temperature, top_k, top_p, repetition_penalty):
    chain = LogitsProcessorList()
    if repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    chain.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        chain.append(TopKLogitsWarper(top_k))
    if top_p is not None:
        chain.append(TopPLogitsWarper(top_p))
    return chain(context, logits.clone())


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "repetition_penalty"), [
    (1.0, None, 0.9, 1.0), (0.7, 20, 0.5, 1.0), (1.3, None, None, 1.3), (0.8, 40, 0.95, 1.2),
    (1.0, 5, 0.3, 0.8), (2.0, None, 0.05, 1.0),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_distribution_is_transformers(seed, temperature, top_k, top_p, repetition_penalty):
    logits, context = random_case(seed)
    ours = Sampling(temperature, top_k, top_p, repetition_penalty).logits(logits, context)
    theirs = transformers_logits(logits, context, temperature, top_k, top_p, repetition_penalty)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))  # the same tokens kept
    kept = ~torch.isinf(ours)
    torch.testing.assert_close(ours[kept], theirs[kept])
    assert kept.sum(dim=-1).min() >= 1


def test_frequency_and_presence_penalties_against_a_count_by_hand():
    logits, context = random_case(3, batch=2, seq=40)
    got = Sampling(temperature=0.0, frequency_penalty=0.4, presence_penalty=0.25).logits(logits, context)
    expected = logits.double().clone()
    for row in range(logits.size(0)):
        for token, count in Counter(context[row].tolist()).items():
            expected[row, token] -= 0.4 * count + 0.25
    torch.testing.assert_close(got.double(), expected)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    keep = [(~torch.isinf(Sampling(1.0, top_p=p).logits(probs.log()))).sum().item() for p in (0.4, 0.8, 0.9, 1.0)]
    assert keep == [1, 2, 3, 4]  # 0.5 >= 0.4; 0.5 + 0.3 >= 0.8; ... ; 1.0 keeps everything


def test_draws_follow_the_filtered_distribution():
    logits, _ = random_case(4, batch=1)
    sampling = Sampling(temperature=1.0, top_k=8, top_p=0.8)
    target = sampling.logits(logits).softmax(dim=-1)[0].double()
    g = torch.Generator().manual_seed(0)
    n = 20_000
    draws = sampling.next_token(logits.expand(n, -1), generator=g).flatten()
    observed = torch.bincount(draws, minlength=VOCAB).double()
    assert observed[target == 0].sum() == 0  # never a filtered-out token
    kept = target > 0
    expected = n * target[kept]
    chi2 = ((observed[kept] - expected) ** 2 / expected).sum().item()
    assert chi2 < 3 * int(kept.sum()) + 20  # chi-square with (kept - 1) degrees of freedom, far in its tail


def test_penalties_change_greedy_decoding():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    prompt = torch.randint(0, VOCAB, (2, 4))
    out = model.generate(prompt, 30, Sampling(presence_penalty=1e4))  # a token once seen is never the argmax again
    assert all(len(set(row.tolist())) == row.numel() for row in out)
    assert not torch.equal(out, model.generate(prompt, 30))


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0, "repetition_penalty": 1.5},
    {"temperature": 0.9, "top_p": 0.7, "frequency_penalty": 0.5},
    {"temperature": 1.1, "top_k": 20, "top_p": 0.9, "presence_penalty": 0.3, "repetition_penalty": 1.2},
])
def test_cached_and_uncached_decoders_draw_the_same_tokens(kwargs):
    torch.manual_seed(1)
    model = GPT(TINY).double().eval()
    prompt = torch.randint(0, VOCAB, (3, 5))
    expected = model.generate(prompt, 25, Sampling(**kwargs), torch.Generator().manual_seed(7))
    got = generate_with_cache(model, prompt, 25, Sampling(**kwargs), torch.Generator().manual_seed(7))
    assert torch.equal(got, expected)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p must be in \\(0, 1\\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
    ({"presence_penalty": float("inf")}, "presence_penalty must be a finite number"),
])
def test_bad_sampling_arguments_are_refused(kwargs, message):
    model = GPT(TINY)
    with pytest.raises(ValueError, match=message):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, Sampling(temperature=1.0, **kwargs))
    with pytest.raises(ValueError, match=message):
        generate_with_cache(model, torch.zeros(1, 2, dtype=torch.long), 2, Sampling(temperature=1.0, **kwargs))


def test_penalties_need_the_context():
    with pytest.raises(ValueError, match="need the context"):
        Sampling(repetition_penalty=1.2).logits(torch.zeros(1, VOCAB))


def test_text_quality_measures_on_hand_worked_examples():
    assert words("The __init__ method, don't") == ["The", "init", "method", "don", "t"]
    assert known_word_fraction("the cat sat on zzq", {"the", "cat", "sat", "on"}) == 0.8
    assert distinct_n([[1, 2, 3, 1, 2], [1, 2, 4]], 2) == 4 / 6  # (1,2) three times; (2,3) (3,1) (2,4) once
    assert distinct_n([[5, 5, 5]], 1) == 1 / 3
    assert repetition_rate([[1, 2, 1, 2, 1, 2], [7, 8, 9, 10]], n=2) == (1 - 2 / 5 + 0) / 2
    with pytest.raises(ValueError, match="generate at least 4 tokens"):
        repetition_rate([[1, 2, 3]], n=4)


def test_self_perplexity_is_the_models_likelihood_token_by_token():
    torch.manual_seed(2)
    model = GPT(TINY).double().eval()
    prompt = torch.randint(0, VOCAB, (2, 3))
    seqs = model.generate(prompt, 12, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    nll = []
    with torch.no_grad():
        for row in seqs:
            for t in range(3, seqs.size(1)):  # each new token, from a forward pass over its own prefix
                nll.append(-model(row[None, :t])[0, -1].log_softmax(-1)[row[t]].item())
    assert self_perplexity(model, seqs, prompt_len=3) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-9)
    with pytest.raises(ValueError, match="prompt_len must be in"):
        self_perplexity(model, seqs, prompt_len=seqs.size(1))


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=5, context_length=16, d_model=16, n_heads=2, n_layers=1, dropout=0.0)).double()


def test_one_beam_is_greedy_decoding(tiny_model):
    prompt = torch.tensor([[1, 3, 0]])
    assert torch.equal(beam_search(tiny_model, prompt, 6, beams=1), tiny_model.generate(prompt, 6))


def continuation_log_prob(model, sequence, prompt_len):
    with torch.no_grad():
        log_probs = torch.log_softmax(model(sequence[:, :-1]).double(), dim=-1)[0]
    new = sequence[0, prompt_len:]
    return log_probs[torch.arange(prompt_len - 1, sequence.size(1) - 1), new].sum().item()


def test_enough_beams_find_the_most_likely_continuation_of_all(tiny_model):
    """vocab ** (n - 1) beams keep every prefix, so beam search is exhaustive: checked against all 5**3 sequences."""
    prompt, n = torch.tensor([[2, 4]]), 3
    every = torch.cartesian_prod(*[torch.arange(5)] * n)
    scores = [continuation_log_prob(tiny_model, torch.cat([prompt, c[None]], dim=1), 2) for c in every]
    best = every[max(range(len(scores)), key=scores.__getitem__)]
    assert torch.equal(beam_search(tiny_model, prompt, n, beams=5 ** (n - 1))[0, 2:], best)
    greedy = tiny_model.generate(prompt, n)  # here greedy misses it: the search is what finds it
    assert continuation_log_prob(tiny_model, greedy, 2) < max(scores) - 1e-9


@pytest.mark.parametrize("kwargs, message", [
    (dict(beams=0), "beams must be a positive integer"),
    (dict(idx=torch.zeros(2, 3, dtype=torch.long)), "one prompt at a time"),
    (dict(max_new_tokens=15), "needs 17 cached positions .* but the context length is 16"),
])
def test_beam_search_refuses_bad_arguments(tiny_model, kwargs, message):
    args = dict(idx=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4, beams=2) | kwargs
    with pytest.raises(ValueError, match=message):
        beam_search(tiny_model, **args)


# ---- one context rule for every decoder that does not slide ----

CONTEXT = 12


def decoders():
    """Each decoder that keeps every position (a cache, or no window): the tokens it returns for a greedy request,
    as decode(target, draft, idx, new) (only speculative decoding uses the draft)."""
    from helpers.inference.kv_cache import generate_with_cache
    from helpers.inference.serving import Request, serve
    from helpers.inference.speculative import speculative_generate

    def engine(model, draft, idx, new):
        run = serve(model, [Request("r", tuple(idx[0].tolist()), new)], max_batch=1, block_size=4, num_blocks=4)
        return torch.cat([idx, torch.tensor([run.completions[0].tokens])], dim=1)

    return {
        "generate_with_cache": lambda model, draft, idx, new: generate_with_cache(model, idx, new),
        "engine": engine,
        "speculative": lambda model, draft, idx, new: speculative_generate(model, draft, idx, new, k=3)[0],
        "beam_search": lambda model, draft, idx, new: beam_search(model, idx, new, beams=1),
    }


@pytest.fixture(scope="module")
def target_and_draft():
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=17, context_length=CONTEXT, d_model=16, n_heads=2, n_layers=1, dropout=0.0))
    torch.manual_seed(1)
    draft = GPT(GPTConfig(vocab_size=17, context_length=CONTEXT, d_model=8, n_heads=1, n_layers=1, dropout=0.0))
    return target.eval(), draft.eval()


@pytest.mark.parametrize("decoder", ["generate_with_cache", "engine", "speculative", "beam_search"])
@pytest.mark.parametrize("total", [CONTEXT - 1, CONTEXT, CONTEXT + 1, CONTEXT + 2])
def test_every_decoder_accepts_and_refuses_the_same_requests(target_and_draft, decoder, total):
    """A prompt plus new tokens may reach context + 1 (the last new token is never fed back), never more: accepted
    or refused alike by the cached generator, the engine, speculative decoding and beam search, and where accepted,
    the same greedy tokens as GPT.generate (which slides, and so needs no rule)."""
    target, draft = target_and_draft
    idx = torch.randint(0, 17, (1, 5), generator=torch.Generator().manual_seed(2))
    new = total - idx.size(1)
    decode = decoders()[decoder]
    if total > CONTEXT + 1:
        with pytest.raises(ValueError, match=f"needs {total - 1} (cached )?positions .* context length is {CONTEXT}"):
            decode(target, draft, idx, new)
        return
    with torch.no_grad():
        assert torch.equal(decode(target, draft, idx, new), target.generate(idx, new))
