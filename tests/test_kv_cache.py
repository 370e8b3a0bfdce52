"""Generation with a KV cache against GPT.generate (no cache) and a whole-sequence forward.

The comparisons run in float64: a one-token step and a whole-sequence forward call different CPU kernels
(the sums are not batch-invariant), so in float32 an argmax between two nearly tied logits could flip. In
float64 the logits agree to ~1e-12, far below any gap between two logits of these models, so the tokens
must be identical.
"""

import dataclasses

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.kv_cache import KVCache, generate_with_cache, kv_cache_bytes_per_token
from helpers.model.decoding import Sampling

TINY = GPTConfig(vocab_size=97, context_length=48, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
VARIANTS = {
    "gpt2": TINY,
    "swiglu-nobias-untied": dataclasses.replace(TINY, ffn_type="swiglu", bias=False, tie_weights=False),
}


def model_for(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).double().eval()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("batch", "prompt_len", "new"), [(1, 1, 20), (1, 9, 15), (3, 5, 20), (4, 12, 24)])
def test_greedy_tokens_identical_to_generate_without_cache(variant, batch, prompt_len, new):
    model = model_for(VARIANTS[variant])
    torch.manual_seed(batch * 100 + prompt_len)
    idx = torch.randint(0, TINY.vocab_size, (batch, prompt_len))
    expected = model.generate(idx, new)
    got = generate_with_cache(model, idx, new)
    assert got.shape == (batch, prompt_len + new)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("chunks", [[10], [4, 1, 1, 1], [3, 5, 2], [1] * 6])
def test_cached_logits_match_whole_sequence_forward(chunks):
    """Prefill in one chunk or several (queries after the first chunk see earlier keys: the offset mask)."""
    model = model_for(TINY)
    idx = torch.randint(0, TINY.vocab_size, (2, sum(chunks)), generator=torch.Generator().manual_seed(1))
    cache = KVCache(TINY, batch=2, max_len=sum(chunks), dtype=torch.float64)
    pieces, start = [], 0
    with torch.no_grad():
        for n in chunks:
            pieces.append(model(idx[:, start : start + n], cache=cache))
            start += n
    assert cache.length == sum(chunks)
    with torch.no_grad():
        expected = model(idx)
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(pieces[-1][:, -1], expected[:, -1])


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, None), (0.7, 10), (1.5, 1)])
def test_sampling_identical_with_the_same_generator(temperature, top_k):
    model = model_for(TINY)
    idx = torch.randint(0, TINY.vocab_size, (3, 4), generator=torch.Generator().manual_seed(2))
    sampling = Sampling(temperature=temperature, top_k=top_k)
    expected = model.generate(idx, 30, sampling, torch.Generator().manual_seed(7))
    got = generate_with_cache(model, idx, 30, sampling, torch.Generator().manual_seed(7))
    assert torch.equal(got, expected)
    other = generate_with_cache(model, idx, 30, sampling, torch.Generator().manual_seed(8))
    assert top_k == 1 or not torch.equal(other, expected)  # the generator, not a fixed seed, drives sampling


def test_generation_restores_training_mode_and_ignores_dropout():
    model = model_for(dataclasses.replace(TINY, dropout=0.3)).train()
    idx = torch.randint(0, TINY.vocab_size, (2, 3), generator=torch.Generator().manual_seed(3))
    got = generate_with_cache(model, idx, 10)
    assert model.training
    assert torch.equal(got, model.generate(idx, 10))


@pytest.mark.parametrize("preset", ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_tensors_match_the_memory_formula(preset, dtype):
    config = GPTConfig.from_preset(preset)
    cache = KVCache(config, batch=2, max_len=3, dtype=dtype)
    assert len(cache.keys) == len(cache.values) == config.n_layers
    expected_shape = (2, config.n_heads, 3, config.head_dim)
    assert all(t.shape == expected_shape and t.dtype == dtype for t in (*cache.keys, *cache.values))
    measured = sum(t.untyped_storage().nbytes() for t in (*cache.keys, *cache.values))
    bytes_per_element = {torch.float32: 4, torch.bfloat16: 2}[dtype]
    assert measured == cache.nbytes == 2 * 3 * 2 * config.n_layers * config.d_model * bytes_per_element
    assert kv_cache_bytes_per_token(config, dtype) == measured // (2 * 3)


def test_generation_fills_the_context_exactly():
    model = model_for(TINY)
    idx = torch.randint(0, TINY.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    new = TINY.context_length - 8
    assert torch.equal(generate_with_cache(model, idx, new), model.generate(idx, new))


def test_the_last_new_token_needs_no_cache_slot():
    """A full-context prompt still gets one new token, and prompt + new may reach context + 1: the last token is
    returned, never fed back (the serving engine's rule)."""
    model = model_for(TINY)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.context_length), generator=torch.Generator().manual_seed(5))
    assert torch.equal(generate_with_cache(model, idx, 1), model.generate(idx, 1))
    short = idx[:, :8]
    new = TINY.context_length - 8 + 1
    assert torch.equal(generate_with_cache(model, short, new), model.generate(short, new))
    with pytest.raises(ValueError, match=f"needs {TINY.context_length + 1} cached positions"):
        generate_with_cache(model, short, new + 1)


@pytest.mark.parametrize(
    ("shape", "new", "kwargs", "message"),
    [
        ((1, 40), 10, {}, "cannot slide"),
        ((1, 49), 1, {}, "the prompt has 49 tokens but the context length is 48"),
        ((1, 4), 0, {}, "max_new_tokens must be an integer >= 1"),
        ((1, 4), -1, {}, "max_new_tokens must be an integer >= 1"),
        ((1, 4), 2.0, {}, "max_new_tokens must be an integer >= 1"),
        ((4,), 2, {}, "shape \\(batch, seq\\)"),
        ((2, 0), 2, {}, "seq >= 1"),
        ((1, 4), 2, {"sampling": Sampling(temperature=-1.0)}, "temperature must be >= 0"),
        ((1, 4), 2, {"sampling": Sampling(temperature=1.0, top_k=0)}, "top_k must be an integer in"),
    ],
)
def test_bad_input_is_rejected_with_a_clear_error(shape, new, kwargs, message):
    model = model_for(TINY)
    with pytest.raises(ValueError, match=message):
        generate_with_cache(model, torch.zeros(shape, dtype=torch.long), new, **kwargs)


def test_float_prompt_and_cache_overflow_are_rejected():
    model = model_for(TINY)
    with pytest.raises(ValueError, match="token ids must be integers"):
        generate_with_cache(model, torch.zeros(1, 3), 2)
    with pytest.raises(TypeError, match="prompts of different lengths"):
        generate_with_cache(model, [[1, 2, 3], [4]], 2)
    cache = KVCache(TINY, batch=1, max_len=4, dtype=torch.float64)
    model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="room for 4 positions; 3 are used"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="holds 1 sequences"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="exceeds the context length"):
        KVCache(TINY, batch=1, max_len=TINY.context_length + 1)
    dropout_model = model_for(dataclasses.replace(TINY, dropout=0.1)).train()
    with pytest.raises(ValueError, match="call model.eval"):
        dropout_model(torch.zeros(1, 1, dtype=torch.long), cache=KVCache(TINY, 1, 4, torch.float64))
    with pytest.raises(RuntimeError, match="flash_torch computes causal attention over a square score matrix only"):
        model_for(TINY).set_attn_implementation("flash_torch")(torch.zeros(1, 1, dtype=torch.long),
                                                               cache=KVCache(TINY, 1, 4, torch.float64))
