"""The compiled decode step over a static KV cache, against the eager KV-cache path (`generate_with_cache`): the same
logits in float64 at every step, the same greedy tokens, one graph for every step, and clear refusals."""

import types

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.compiled_decode import CompiledDecoder, StaticKVCache
from helpers.inference.kv_cache import KVCache, generate_with_cache
from helpers.inference.kv_quant import dequantize_kv, quantize_kv
from helpers.model.attention import decode_attention
from helpers.model.decoding import Sampling

GPT2_STYLE = GPTConfig(vocab_size=97, context_length=40, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
MODERN = GPTConfig(vocab_size=97, context_length=40, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, dropout=0.0,
                   norm="rmsnorm", position_encoding="rope", ffn_type="swiglu", bias=False, tie_weights=False,
                   qk_norm=True)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_decode_attention_is_attention_over_the_cache(kv_heads):
    """SDPA over the cached keys and values, in float64, with masked slots (not written yet) left out whatever they
    hold; for an int8 cache, with the scales on the scores and weights, SDPA over the dequantized numbers."""
    torch.manual_seed(0)
    q = torch.randn(3, 4, 1, 16, dtype=torch.float64)
    keys, key_scales = quantize_kv(torch.randn(3, kv_heads, 10, 16, dtype=torch.float64))
    values, value_scales = quantize_kv(torch.randn(3, kv_heads, 10, 16, dtype=torch.float64))
    allowed = torch.arange(10)[None, :] <= 6
    k, v = (dequantize_kv(t, s, torch.float64).repeat_interleave(4 // kv_heads, dim=1)
            for t, s in ((keys, key_scales), (values, value_scales)))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(decode_attention(q, keys, values, allowed, key_scales, value_scales), expected,
                               rtol=0, atol=1e-13)
    k, v = (dequantize_kv(t, s, torch.float64) for t, s in ((keys, key_scales), (values, value_scales)))
    torch.testing.assert_close(decode_attention(q, k, v, allowed), expected, rtol=0, atol=1e-13)


def model_and_prompts(config, dtype=torch.float64, batch=2, seq=7):
    torch.manual_seed(0)
    model = GPT(config).to(dtype).eval()
    return model, torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kv_format", ["auto", "int8"], ids=["float", "int8-kv"])
@pytest.mark.parametrize("config", [GPT2_STYLE, MODERN], ids=["gpt2", "rope-gqa-qknorm"])
def test_static_cache_gives_the_kv_cache_logits_in_float64_at_every_step(config, kv_format):
    """Eager (compile=False): the static cache's prefill and each decode step against KVCache's, position by
    position, with learned positions and with RoPE + grouped-query attention, and with both caches in int8."""
    model, prompts = model_and_prompts(config)
    decoder = CompiledDecoder(model, batch=2, max_len=20, compile=False, kv_cache_dtype=kv_format)
    reference = KVCache(config, 2, 20, torch.float64, kv_format=kv_format)
    with torch.no_grad():
        ours = decoder.prefill(prompts)
        theirs = model(prompts, cache=reference)[:, -1]
        for position in range(prompts.size(1), 20):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
            token = ours.argmax(-1, keepdim=True)
            ours = decoder.decode(token, torch.tensor([position]))
            theirs = model(token, cache=reference)[:, -1]


def test_a_shorter_generation_after_a_longer_one_ignores_the_stale_slots():
    """Slots written by an earlier, longer generation stay in the buffers; the mask must hide them."""
    model, prompts = model_and_prompts(GPT2_STYLE)
    decoder = CompiledDecoder(model, batch=2, max_len=30, compile=False)
    decoder.generate(prompts, 20)  # fills slots 0..25
    short = prompts[:, :3]
    reference = KVCache(GPT2_STYLE, 2, 30, torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(decoder.prefill(short), model(short, cache=reference)[:, -1], rtol=0, atol=1e-12)
        token = short[:, -1:]
        torch.testing.assert_close(decoder.decode(token, torch.tensor([3])), model(token, cache=reference)[:, -1],
                                   rtol=0, atol=1e-12)
    assert torch.equal(decoder.generate(short, 6), generate_with_cache(model, short, 6))


def test_bad_sizes_are_refused_with_what_to_build():
    model, prompts = model_and_prompts(GPT2_STYLE)
    decoder = CompiledDecoder(model, batch=2, max_len=12, compile=False)
    with pytest.raises(ValueError, match="built for batch 2 and 12 positions; these prompts need batch 2 and 16"):
        decoder.generate(prompts, 10)
    with pytest.raises(ValueError, match="need batch 1 and 16: build a CompiledDecoder"):
        decoder.generate(prompts[:1], 10)
    with pytest.raises(ValueError, match="max_len <= the context length 40"):
        StaticKVCache(GPT2_STYLE, 1, 41)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        decoder.generate(prompts, 0)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp8'; valid: auto, int8"):
        CompiledDecoder(model, batch=2, max_len=12, compile=False, kv_cache_dtype="fp8")


@pytest.mark.compile
def test_one_graph_serves_every_step():
    """Fixed shapes and the position as a tensor: tracing happens once, however many steps and generations follow
    (a backend that counts the graphs it is given and runs them as traced)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    model, prompts = model_and_prompts(MODERN)
    decoder = CompiledDecoder(model, batch=2, max_len=30, backend=counting)
    expected = generate_with_cache(model, prompts, 12)
    assert torch.equal(decoder.generate(prompts, 12), expected)
    assert torch.equal(decoder.generate(prompts, 12), expected)
    assert len(graphs) == 1


@pytest.mark.compile
def test_the_step_compiles_where_a_freed_builtin_left_its_address(monkeypatch):
    """A Jupyter kernel makes `input` a new bound method for every cell and frees it after, and Dynamo keeps the ids
    of the builtins it first saw: a bound method allocated later at that address is a builtin to it (a notebook
    failed so). Here every bound method is one; the step still compiles and gives the eager cache's tokens."""
    from torch._dynamo import trace_rules

    is_builtin = trace_rules.is_builtin_callable
    monkeypatch.setattr(trace_rules, "is_builtin_callable",
                        lambda obj: isinstance(obj, types.MethodType) or is_builtin(obj))
    torch.compiler.reset()
    model, prompts = model_and_prompts(GPT2_STYLE)
    decoder = CompiledDecoder(model, batch=2, max_len=30, backend="eager")
    assert torch.equal(decoder.generate(prompts, 8), generate_with_cache(model, prompts, 8))


@pytest.mark.compile
def test_inductor_step_is_token_identical_to_the_eager_cache():
    """The default backend (inductor, fused kernels): the same tokens in float64 greedily, with seeded sampling and
    with an int8 cache; and greedy in float32, the compute dtype of a CPU without native bf16."""
    torch.compiler.reset()
    model, prompts = model_and_prompts(GPT2_STYLE)
    decoder = CompiledDecoder(model, batch=2, max_len=30)
    assert torch.equal(decoder.generate(prompts, 20), generate_with_cache(model, prompts, 20))
    sampling = Sampling(temperature=0.9, top_k=20)
    sampled = decoder.generate(prompts, 20, sampling, torch.Generator().manual_seed(3))
    assert torch.equal(sampled, generate_with_cache(model, prompts, 20, sampling, torch.Generator().manual_seed(3)))
    int8 = CompiledDecoder(model, batch=2, max_len=30, kv_cache_dtype="int8")
    assert torch.equal(int8.generate(prompts, 20), generate_with_cache(model, prompts, 20, kv_cache_dtype="int8"))
    model32, prompts = model_and_prompts(GPT2_STYLE, torch.float32)
    decoder32 = CompiledDecoder(model32, batch=2, max_len=30)
    assert torch.equal(decoder32.generate(prompts, 20), generate_with_cache(model32, prompts, 20))
