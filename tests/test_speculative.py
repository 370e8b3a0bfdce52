"""Speculative decoding against the target alone: greedy tokens identical (float64), sampled tokens distributed as
the target's (chi-square over many seeds), the rejection rule against its closed form, the draft's distillation
loss against torch.distributions' KL divergence, and bad input refused."""

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.kv_cache import KVCache
from helpers.inference.speculative import accept_or_resample, distillation_loss, speculative_generate
from helpers.model.decoding import Sampling

VOCAB = 37
TARGET = GPTConfig(vocab_size=VOCAB, context_length=96, d_model=32, n_heads=2, n_layers=2, dropout=0.0)
DRAFT = GPTConfig(vocab_size=VOCAB, context_length=96, d_model=16, n_heads=2, n_layers=1, dropout=0.0)


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """The statistic and its number of cells, cells expected fewer than 5 times pooled into one (the usual rule)."""
    assert observed[expected == 0].sum() == 0, "a token the target gives probability 0 was drawn"
    small = expected < 5
    observed = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
    expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    kept = expected > 0
    return (((observed[kept] - expected[kept]) ** 2) / expected[kept]).sum().item(), int(kept.sum())


def passes(observed: torch.Tensor, expected: torch.Tensor) -> bool:
    """Far in the tail of a chi-square with cells - 1 degrees of freedom (as tests/test_decoding.py)."""
    statistic, cells = chi_square(observed, expected)
    return statistic < 3 * cells + 20


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    target = GPT(TARGET).double().eval()
    torch.manual_seed(1)
    draft = GPT(DRAFT).double().eval()
    return target, draft


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("prompt_len", [1, 7])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_is_token_identical_to_the_target_alone(models, k, prompt_len, penalty):
    target, draft = models
    idx = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(k))
    sampling = Sampling(repetition_penalty=penalty)
    expected = target.generate(idx, 40, sampling)
    out, stats = speculative_generate(target, draft, idx, 40, k=k, sampling=sampling)
    assert torch.equal(out, expected)
    assert stats.accepted + stats.rounds >= 40 and stats.proposed <= k * stats.rounds
    same, same_stats = speculative_generate(target, target, idx, 40, k=k, sampling=sampling)
    assert torch.equal(same, expected) and same_stats.acceptance_rate == 1.0  # a perfect draft is always kept


@pytest.mark.parametrize("k", [3, 8])
def test_a_request_that_fills_the_context_is_served(models, k):
    """Prompt + new tokens = the context length, with k drafts more than the last round has room for: the drafts
    stop at the requested length, so the request fits (it was refused for needing k positions more)."""
    target, draft = models
    idx = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(3))
    out, _ = speculative_generate(target, draft, idx, 16, k=k)
    assert out.shape == (1, TARGET.context_length) and torch.equal(out, target.generate(idx, 16))


def test_the_rejection_rule_draws_from_the_target():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.2, 0.1, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.4, 0.0, 0.2, 0.3, 0.0], dtype=torch.float64)  # mass where p has none, none where it has
    draws, kept = 20_000, 0
    counts = torch.zeros(6)
    for _ in range(draws):
        d = int(torch.multinomial(q, 1, generator=g))
        ok, token = accept_or_resample(p, q, d, g)
        kept += ok
        counts[token] += 1
    assert passes(counts, p.float() * draws)
    assert abs(kept / draws - torch.minimum(p, q).sum().item()) < 0.02  # P(keep) = sum of min(p, q)


@pytest.mark.parametrize("k", [1, 3])
def test_sampled_tokens_are_distributed_as_the_targets(k):
    """The first two tokens over many seeds against the target's exact joint p(t1) p(t2 | t1), with a draft that
    disagrees with it (tiny vocabulary, so every pair of tokens is a cell)."""
    vocab = 5
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=vocab, context_length=32, d_model=16, n_heads=2, n_layers=1,
                           dropout=0.0)).double().eval()
    torch.manual_seed(3)
    draft = GPT(GPTConfig(vocab_size=vocab, context_length=32, d_model=8, n_heads=1, n_layers=1,
                          dropout=0.0)).double().eval()
    with torch.no_grad():  # make the two models disagree clearly
        target.lm_head.weight.mul_(8)
        draft.lm_head.weight.mul_(-8)
    idx = torch.tensor([[1, 2, 3]])
    sampling = Sampling(temperature=1.0)
    with torch.no_grad():
        p1 = torch.softmax(sampling.logits(target(idx)[:, -1]), -1)[0]
        p2 = torch.stack([torch.softmax(sampling.logits(target(torch.cat([idx, torch.tensor([[t]])], 1))[:, -1]), -1)[0]
                          for t in range(vocab)])
    joint = (p1[:, None] * p2).flatten()
    draws = 1500
    counts = torch.zeros(vocab * vocab)
    g = torch.Generator().manual_seed(1)
    accepted = proposed = 0
    for _ in range(draws):
        out, stats = speculative_generate(target, draft, idx, 2, k=k, sampling=sampling, generator=g)
        counts[out[0, -2] * vocab + out[0, -1]] += 1
        accepted, proposed = accepted + stats.accepted, proposed + stats.proposed
    assert passes(counts, joint.float() * draws)
    assert 0 < accepted < proposed  # both paths (kept and resampled) were taken


@pytest.mark.parametrize("change, message", [
    (dict(idx=torch.zeros(2, 3, dtype=torch.long)), "one sequence at a time"),
    (dict(k=0), "k \\(draft tokens per round\\) must be a positive integer"),
    (dict(max_new_tokens=95), "the target: a prompt of 3 tokens plus 95 new tokens needs 97 cached positions"),
])
def test_bad_arguments_are_refused(models, change, message):
    target, draft = models
    args = dict(idx=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=5, k=4) | change
    with pytest.raises(ValueError, match=message):
        speculative_generate(target, draft, **args)


def test_a_draft_with_another_vocabulary_is_refused(models):
    target, _ = models
    other = GPT(GPTConfig(vocab_size=VOCAB + 1, context_length=96, d_model=16, n_heads=2, n_layers=1, dropout=0.0))
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        speculative_generate(target, other, torch.zeros(1, 3, dtype=torch.long), 5)


def test_truncating_a_cache_refuses_to_grow_it():
    cache = KVCache(TARGET, 1, 10)
    cache.advance(4)
    cache.truncate(2)
    assert cache.length == 2
    with pytest.raises(ValueError, match="can truncate the cache to 0 .. 2 positions, not 3"):
        cache.truncate(3)


def test_distillation_loss_is_the_kl_divergence_from_the_targets_distribution():
    torch.manual_seed(0)
    draft_logits, target_logits = torch.randn(3, 5, VOCAB, dtype=torch.float64), torch.randn(3, 5, VOCAB) * 3
    reference = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=target_logits.double()),
                                                  torch.distributions.Categorical(logits=draft_logits)).mean()
    loss = distillation_loss(draft_logits, target_logits)
    assert loss.dtype == torch.float64 and torch.allclose(loss, reference, rtol=1e-12)
    assert distillation_loss(target_logits + 7.0, target_logits).abs() < 1e-6  # the same distribution: zero
    with pytest.raises(ValueError, match="must have the same shape"):
        distillation_loss(draft_logits[:, :4], target_logits)


def test_distilling_a_draft_raises_its_acceptance(models):
    """The reason to distil: a few steps on the target's distribution make a random draft agree with it."""
    target, draft = models
    student = GPT(DRAFT).double()
    student.load_state_dict(draft.state_dict())
    prompts = [torch.tensor([[1, 2, 3]]), torch.tensor([[5, 9, 20, 30]])]

    def acceptance():
        stats = [speculative_generate(target, student.eval(), prompt, 60, k=4)[1] for prompt in prompts]
        return sum(s.accepted for s in stats) / sum(s.proposed for s in stats)

    before = acceptance()
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        windows = torch.randint(0, VOCAB, (8, 32), generator=generator)
        with torch.no_grad():
            target_logits = target(windows)
        loss = distillation_loss(student.train()(windows), target_logits)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = acceptance()
    assert before < 0.5 and after > 0.9, (before, after)
