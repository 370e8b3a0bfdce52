"""The KV format is chosen once and every cache obeys it: each format's bytes per token against the formulas and
the tensors the caches allocate, a new format as one class that the contiguous cache, the paged engine and the
static cache all store and read, and clear refusals of unknown names."""

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.compiled_decode import CompiledDecoder
from helpers.inference.kv_cache import KVCache, generate_with_cache, kv_cache_bytes_per_token
from helpers.inference.kv_format import KV_FORMATS, KVFormat, as_kv_format
from helpers.inference.kv_quant import kv_bytes_per_token_int8
from helpers.inference.paged_kv import PagedKVCache
from helpers.inference.serving import Request, serve

GQA = GPTConfig(vocab_size=61, context_length=32, d_model=48, n_heads=6, n_kv_heads=2, n_layers=3, dropout=0.0,
                norm="rmsnorm", position_encoding="rope", ffn_type="swiglu", bias=False)


class Float16KV(KVFormat):
    """A format the helpers do not ship: keys and values kept in float16, whatever the model computes in."""

    name = "float16"

    def stored_dtype(self, dtype):
        return torch.float16

    def encode(self, x):
        return x.to(torch.float16), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_format_sizes_what_the_caches_allocate(dtype):
    formulas = {"auto": kv_cache_bytes_per_token(GQA, dtype), "int8": kv_bytes_per_token_int8(GQA)}
    assert set(formulas) == set(KV_FORMATS)
    for name, expected in formulas.items():
        fmt = as_kv_format(name)
        assert fmt.bytes_per_token(GQA, dtype) == expected
        contiguous = KVCache(GQA, batch=2, max_len=5, dtype=dtype, kv_format=fmt)
        assert contiguous.nbytes == 2 * 5 * expected
        paged = PagedKVCache(GQA.n_layers, GQA.kv_heads, GQA.head_dim, num_blocks=3, block_size=4, dtype=dtype,
                             kv_format=name)
        assert paged.bytes_per_slot == expected


def test_a_new_format_is_one_class_that_every_cache_stores_and_reads():
    """Float16 storage under a float64 model: the contiguous cache, the paged engine and the static cache each hold
    float16 tensors, and give one another's greedy tokens; the logits move off the float64 cache's by float16's
    rounding, no more."""
    torch.manual_seed(0)
    model = GPT(GQA).double().eval()
    fmt = Float16KV()
    prompts = torch.randint(0, GQA.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))

    exact = KVCache(GQA, 2, 6, torch.float64)
    rounded = KVCache(GQA, 2, 6, torch.float64, kv_format=fmt)
    with torch.no_grad():
        gap = (model(prompts, cache=rounded) - model(prompts, cache=exact)).abs().max().item()
    assert rounded.keys[0].dtype == rounded.values[-1].dtype == torch.float16
    assert 0 < gap < 1e-2

    contiguous = generate_with_cache(model, prompts, 10, kv_cache_dtype=fmt)
    decoder = CompiledDecoder(model, batch=2, max_len=16, compile=False, kv_cache_dtype=fmt)
    assert decoder.cache.storage.keys[0].dtype == torch.float16
    assert torch.equal(decoder.generate(prompts, 10), contiguous)
    run = serve(model, [Request(i, tuple(p.tolist()), 10) for i, p in enumerate(prompts)], max_batch=2,
                block_size=4, kv_cache_dtype=fmt)
    assert [c.tokens for c in run.completions] == contiguous[:, 6:].tolist()


@pytest.mark.parametrize("name", ["fp8", "INT8", "", None, ["int8"]])
def test_an_unknown_format_is_refused_naming_the_valid_ones(name):
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype .*; valid: auto, int8"):
        as_kv_format(name)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        KVCache(GQA, 1, 4, kv_format=name)
