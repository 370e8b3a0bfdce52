"""The int8 KV cache: the rounding bound of per-position, per-head scales against float64, the contiguous cache's
logits against a float64 attention over keys and values rounded the same way, the bytes the cache tensors hold,
and the paged engine with an int8 cache against the contiguous int8 cache, token for token."""

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.cached_attention import KVRead
from helpers.inference.kv_cache import KVCache, generate_with_cache, kv_cache_bytes_per_token
from helpers.inference.kv_quant import dequantize_kv, kv_bytes_per_token_int8, quantize_kv
from helpers.inference.paged_kv import PagedKVCache
from helpers.inference.serving import Engine, Request, serve

CONFIG = GPTConfig(vocab_size=89, context_length=48, d_model=48, n_heads=3, n_layers=2, dropout=0.0)


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    return GPT(CONFIG).double().eval()


def test_rounding_error_is_at_most_half_a_step_per_position_and_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 50, 16, dtype=torch.float64, generator=g)
    x = x * torch.logspace(-3, 2, 50, dtype=torch.float64)[:, None]
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 50, 1)
    assert q.abs().max() == 127 and (q.abs().amax(-1) == 127).all()  # each row's largest value hits the top code
    step = x.abs().amax(-1, keepdim=True) / 127
    err = (dequantize_kv(q, scale, torch.float64) - x).abs()
    # quantize_kv works in float32: x, x / scale and the scale itself each round by a relative 2^-24 at most
    assert (err <= step / 2 + x.abs() * 2**-22).all()
    zeros, zero_scale = quantize_kv(torch.zeros(2, 8))
    assert (zeros == 0).all() and torch.isfinite(zero_scale).all()


class FakeQuantCache:
    """The reference: keys and values rounded to steps of absmax / 127 per position and head, written out in
    float64, for one prefill of a whole sequence; the model's backend attends over them."""

    def positions(self, seq, device):
        return torch.arange(seq, device=device)

    def update(self, layer, k, v):
        def rounded(x):
            step = x.abs().amax(-1, keepdim=True) / 127
            return torch.round(x / step) * step

        return [KVRead(rounded(k), rounded(v))]

    def advance(self, seq):
        pass


def test_int8_cache_logits_equal_attention_over_rounded_keys_and_values(model64):
    idx = torch.randint(0, CONFIG.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        float_logits = model64(idx, cache=KVCache(CONFIG, 2, 40, torch.float64))
        int8_logits = model64(idx, cache=KVCache(CONFIG, 2, 40, torch.float64, kv_format="int8"))
        reference = torch.cat([model64(idx[i : i + 1], cache=FakeQuantCache()) for i in range(2)])
    assert (int8_logits - reference).abs().max() < 1e-6
    assert (int8_logits - float_logits).abs().max() > 1e-4  # the rounding is there, and this test sees it


def test_int8_decode_steps_read_what_earlier_steps_stored(model64):
    """Prefill then one token at a time through an int8 cache gives the logits of one int8 prefill of it all."""
    idx = torch.randint(0, CONFIG.vocab_size, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model64(idx, cache=KVCache(CONFIG, 1, 30, torch.float64, kv_format="int8"))
        cache = KVCache(CONFIG, 1, 30, torch.float64, kv_format="int8")
        steps = [model64(idx[:, :10], cache=cache)] + [model64(idx[:, t : t + 1], cache=cache) for t in range(10, 30)]
    assert (torch.cat(steps, dim=1) - whole).abs().max() < 1e-12


@pytest.mark.parametrize("preset", ["gpt2-small", "gpt2-xl", "llama-cpu"])
def test_int8_cache_bytes_match_the_formula_and_halve_bf16(preset):
    config = GPTConfig.from_preset(preset)
    cache = KVCache(config, batch=2, max_len=3, dtype=torch.float32, kv_format="int8")
    tensors = (*cache.keys, *cache.values, *cache.storage.key_scales, *cache.storage.value_scales)
    measured = sum(t.untyped_storage().nbytes() for t in tensors)
    assert measured == cache.nbytes == 2 * 3 * kv_bytes_per_token_int8(config)
    paged = PagedKVCache(config.n_layers, config.kv_heads, config.head_dim, num_blocks=2, block_size=4,
                         kv_format="int8")
    assert paged.bytes_per_slot == kv_bytes_per_token_int8(config)
    assert kv_cache_bytes_per_token(config, torch.bfloat16) / kv_bytes_per_token_int8(config) >= 1.8
    assert kv_cache_bytes_per_token(config, torch.float32) / kv_bytes_per_token_int8(config) >= 3.5


def test_paged_int8_reads_back_the_rounded_values():
    cache = PagedKVCache(1, 2, 8, num_blocks=4, block_size=3, dtype=torch.float64, kv_format="int8")
    cache.reserve("a", 7)
    k, v = torch.randn(2, 7, 2, 8, dtype=torch.float64)
    cache.write(0, cache.slots("a", 0, 7), k, v)
    k_read, v_read = cache.gather(0, "a", 7)  # (heads, positions, head_dim)
    for read, x in ((k_read, k), (v_read, v)):
        assert read.dtype == torch.float64
        assert torch.equal(read, dequantize_kv(*quantize_kv(x), torch.float64).transpose(0, 1))


def test_engine_with_an_int8_cache_gives_the_int8_cache_tokens_of_each_request(model64):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, CONFIG.vocab_size, (9,), generator=g).tolist()  # ends inside a 4-token block
    requests = [Request(i, tuple(shared[: i % 2 * 9] + torch.randint(0, CONFIG.vocab_size, (int(n),), generator=g)
                                 .tolist()), 12) for i, n in enumerate(torch.randint(2, 20, (6,), generator=g))]
    expected = [generate_with_cache(model64, torch.tensor([r.prompt]), r.max_tokens, kv_cache_dtype="int8")
                [0, len(r.prompt) :].tolist() for r in requests]
    for args in (dict(max_batch=2, block_size=4), dict(max_batch=6, block_size=2, num_blocks=20),
                 dict(max_batch=3, block_size=4, prefix_caching=True)):
        run = serve(model64, requests, kv_cache_dtype="int8", **args)
        assert [c.tokens for c in run.completions] == expected, args
    assert run.cached_tokens >= 2 * 9  # the last run shared the prefix, copying the block it ends in
    assert serve(model64, requests, max_batch=6, block_size=2, num_blocks=20, kv_cache_dtype="int8").preemptions > 0


def test_unknown_kv_cache_dtype_is_rejected(model64):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'fp4'; valid: auto, int8"):
        Engine(model64, max_batch=2, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        generate_with_cache(model64, torch.tensor([[1, 2]]), 2, kv_cache_dtype="float8")


def test_copy_on_write_copies_the_scales_with_the_int8_values():
    cache = PagedKVCache(1, 2, 8, num_blocks=6, block_size=4, dtype=torch.float64, prefix_caching=True,
                         kv_format="int8")
    a = list(range(1, 9))
    cache.reserve("a", 8)
    k, v = torch.randn(2, 8, 2, 8, dtype=torch.float64) * 5
    cache.write(0, cache.slots("a", 0, 8), k, v)
    cache.commit("a", a, 8)
    cache.attach("b", cache.match_prefix(a[:6] + [0]), 7)  # diverges inside a's second block: a copy
    assert cache.block_tables["b"][1] != cache.block_tables["a"][1]
    for got, want in zip(cache.gather(0, "b", 6), cache.gather(0, "a", 6), strict=True):
        assert torch.equal(got, want)
