"""Every attention implementation against a float64 reference: outputs and gradients."""

import contextlib
import copy
import importlib.metadata
import json
import math

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.measure.attention_bench import flash_refusal, sdpa_backend_used
from helpers.model.attention import IMPLEMENTATIONS, AttentionCall, CausalSelfAttention, unavailable_reason
from helpers.system import optional

NAMES = list(IMPLEMENTATIONS)
# (batch, seq, d_in, d_model, heads): batch 1, seq 1, lengths that are neither powers of two nor
# multiples of a block, d_in != d_model.
SHAPES = [(1, 1, 24, 32, 4), (2, 37, 24, 32, 4), (1, 67, 32, 32, 2), (3, 130, 48, 64, 4)]


def reference_attention(x, qkv_w, qkv_b, out_w, out_b, heads):
    """softmax(QK^T / sqrt(d) + causal mask) V per head, then the output projection."""
    batch, seq, _ = x.shape
    q, k, v = (x @ qkv_w.T + qkv_b).chunk(3, dim=-1)
    q, k, v = (t.view(batch, seq, heads, -1).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
    return y @ out_w.T + out_b


def make_case(name, shape, requires_grad):
    batch, seq, d_in, d_model, heads = shape
    call = AttentionCall("cpu", torch.float32, backward=requires_grad, reshapes=d_in != d_model)
    reason = unavailable_reason(name, call)
    if reason:
        pytest.skip(f"{name}: {reason}")
    torch.manual_seed(0)
    module = CausalSelfAttention(d_model, heads, attn_implementation=name, d_in=d_in)
    x = torch.randn(batch, seq, d_in, requires_grad=requires_grad)
    params = [module.qkv.weight, module.qkv.bias, module.out_proj.weight, module.out_proj.bias]
    ref_inputs = [t.detach().double().requires_grad_(requires_grad) for t in (x, *params)]
    return module, x, params, ref_inputs, heads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_float64_reference(name, shape):
    module, x, _, ref_inputs, heads = make_case(name, shape, requires_grad=False)
    with torch.no_grad():
        out = module(x)
    expected = reference_attention(*ref_inputs, heads)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_float64_reference(name, shape):
    module, x, params, ref_inputs, heads = make_case(name, shape, requires_grad=True)
    grad_out = torch.randn(shape[0], shape[1], shape[3])
    module(x).backward(grad_out)
    reference_attention(*ref_inputs, heads).backward(grad_out.double())
    for ours, ref in zip((x, *params), ref_inputs, strict=True):
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-5)


def test_unavailable_implementations_say_why():
    assert "d_in == d_model" in unavailable_reason("nn_mha", AttentionCall("cpu", torch.float32, reshapes=True))
    training = AttentionCall("cpu", torch.float32, backward=True)
    assert "no backward pass on CPU" in unavailable_reason("flex_attention", training)
    assert unavailable_reason("flex_attention", AttentionCall("cpu", torch.float32)) is None
    assert "attention dropout" in unavailable_reason("flash_torch", AttentionCall("cpu", torch.float32, dropout=0.1))
    module = CausalSelfAttention(32, 4, dropout=0.1, attn_implementation="flash_torch").train()
    with pytest.raises(RuntimeError, match="'flash_torch' cannot run here: .*no attention dropout"):
        module(torch.randn(1, 5, 32))
    if torch.cuda.is_available() is False:
        with pytest.raises(RuntimeError, match="flash_attention_2"):
            CausalSelfAttention(32, 4, attn_implementation="flash_attention_2")(torch.randn(1, 5, 32))


def test_forwards_read_package_metadata_at_most_once(monkeypatch):
    # A metadata lookup (0.2-1.4 ms) per forward would take longer than the attention it asks about.
    lookups = []

    def counting_version(dist):  # flash-attn "installed", as on a GPU machine
        lookups.append(dist)
        return "2.7.4" if dist == "flash-attn" else real_version(dist)

    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", counting_version)
    monkeypatch.setattr(optional, "FOUND_VERSIONS", {})  # an earlier test may have looked it up already
    x = torch.randn(1, 5, 32)
    for name in ("sdpa", "flash_attention_2"):  # flash_attention_2 asks whether flash-attn is installed (then refuses
        # the CPU)
        module = CausalSelfAttention(32, 4, attn_implementation=name)
        for _ in range(3):
            with contextlib.suppress(RuntimeError):
                module(x)
    assert len(lookups) <= 1, lookups


def test_a_package_installed_mid_session_is_seen(monkeypatch):
    installed = {}

    def version(dist):
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(optional, "FOUND_VERSIONS", {})
    assert optional.version_of("flash_attn") is None
    installed["flash-attn"] = "2.7.4"  # pip install flash-attn, in the same session
    assert optional.version_of("flash_attn") == "2.7.4"


def test_gpt_gives_the_same_logits_under_every_available_implementation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=101, context_length=48, d_model=64, n_heads=4, n_layers=2, dropout=0.0))
    model.eval()
    idx = torch.randint(0, 101, (2, 45))
    with torch.no_grad():
        expected = model(idx)
        ran = []
        for name in NAMES:
            if unavailable_reason(name, AttentionCall("cpu", torch.float32)) is None:
                torch.testing.assert_close(copy.deepcopy(model).set_attn_implementation(name)(idx), expected,
                                           rtol=1e-4, atol=1e-4)
                ran.append(name)
    assert {"eager", "sdpa", "flex_attention", "flash_torch"} <= set(ran)


def test_which_sdpa_backend_ran_on_cpu():
    q = torch.randn(1, 2, 64, 32)
    assert sdpa_backend_used(q, q, q, is_causal=True) == "flash_attention"
    assert sdpa_backend_used(q, q, q, is_causal=True, dropout_p=0.5) == "math"
    assert flash_refusal(q, q, q, is_causal=True) is None
    assert "dropout" in flash_refusal(q, q, q, is_causal=True, dropout_p=0.5)


def test_bench_attention_cli_json(python_process):
    out = python_process("-m", "helpers", "bench-attention", "--batch", "1", "--seq", "32", "--d-model", "32",
                         "--heads", "2", "--mode", "fwdbwd", "--json", "--min-run-time", "0.01", "--only", "sdpa",
                         "eager", "flex_attention", "flash_attention_2", check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert set(rows) == {"sdpa", "eager", "flex_attention", "flash_attention_2"}
    for row in rows.values():
        assert {"name", "status", "median_ms", "peak_mem_bytes", "ratio_vs_sdpa", "reason"} <= set(row)
    assert rows["sdpa"]["status"] == "ok" and rows["sdpa"]["ratio_vs_sdpa"] == 1.0
    assert rows["eager"]["median_ms"] > 0 and rows["eager"]["peak_mem_bytes"] >= 0
    assert rows["flex_attention"]["status"] == "skipped" and "CPU" in rows["flex_attention"]["reason"]
    if not torch.cuda.is_available():
        assert rows["flash_attention_2"]["status"] == "skipped" and rows["flash_attention_2"]["reason"]


@pytest.mark.compile
def test_compiled_bench_compiles_every_implementation_past_the_recompile_limit():
    from helpers.measure.attention_bench import make_step

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    # What the bench compiles on CPU (not flash_torch; flash_triton's interpreter does not trace), at two lengths:
    # 16 compilations of CausalSelfAttention.forward, twice dynamo's recompile limit.
    names = ["wrapper", "stacked", "eager", "einsum", "sdpa", "sdpa_mask", "nn_mha", "flex_attention"]
    for name, seq in [(name, seq) for seq in (8, 16) for name in names]:
        _, step = make_step(name, 1, seq, 16, 2, torch.float32, torch.device("cpu"), "compiled",
                            backend=counting_backend)
        before = len(graphs)
        step()
        assert len(graphs) > before, f"{name} at seq {seq} ran eagerly instead of compiled"


@pytest.mark.subprocess  # each implementation's peak RSS is measured in a fresh process
@pytest.mark.serial
def test_tiled_and_fused_attention_peak_memory_is_a_fraction_of_eager():
    from helpers.measure.attention_bench import bench_attention

    rows = {r.name: r.peak_mem_bytes for r in bench_attention(1, 2048, 64, 4, mode="fwd", min_run_time=0.01,
                                                              names=["eager", "sdpa", "flash_torch"])}
    scores = 4 * 2048 * 2048 * 4  # one float32 score matrix
    assert rows["eager"] > scores  # eager holds at least the T x T scores
    assert rows["flash_torch"] < rows["eager"] / 5
    assert rows["sdpa"] < rows["eager"] / 5


@pytest.mark.compile
def test_gpu_benchmark_script_runs_in_smoke_mode(chapter_script, tmp_path):
    chapter_script("ch03_attention/gpu_benchmark.py").main(["--smoke", "--out", str(tmp_path)])
    (result,) = tmp_path.glob("attention_*.json")
    run = json.loads(result.read_text())
    assert set(run["modes"]) == {"fwd", "fwdbwd", "compiled"}
    assert {r["name"] for r in run["modes"]["fwd"]} == set(IMPLEMENTATIONS)
    assert run["max_seq"]["sdpa"] == 128 and list(tmp_path.glob("attention_*.png"))


def float64_attention(q, k, v, dropout_p=0.0, attn_mask=None, is_causal=True):
    """softmax(QK^T)V written out in float64, cast back: the kernel of the test backends below."""
    scores = q.double() @ k.double().transpose(-2, -1) / q.size(-1) ** 0.5
    if is_causal:
        attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return (scores.softmax(-1) @ v.double()).to(q.dtype)


@contextlib.contextmanager
def registered(backend):
    from helpers.model.attention import register

    register(backend)
    try:
        yield backend
    finally:
        IMPLEMENTATIONS.pop(backend.name)


TOY = GPTConfig(vocab_size=61, context_length=24, d_model=32, n_heads=4, n_layers=2, dropout=0.0)


def toy_and_reference(name, dtype=torch.float32):
    """A model on the backend `name` and the same weights on SDPA, with two prompts of 9 tokens."""
    torch.manual_seed(0)
    reference = GPT(TOY).to(dtype).eval()
    toy = GPT(TOY, attn_implementation=name).to(dtype).eval()
    toy.load_state_dict(reference.state_dict())
    return toy, reference, torch.randint(TOY.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))


def test_a_new_backend_is_one_class_and_runs_through_the_model_the_kv_cache_the_engine_and_the_compiled_decoder():
    """A backend added as one registered class serves the model, `generate_with_cache`, the serving engine and the
    compiled decoder's static cache, and its limits are asked before it runs: here a float64 softmax(QK^T)V written
    out, against the model on SDPA."""
    from helpers.inference.compiled_decode import CompiledDecoder
    from helpers.inference.kv_cache import generate_with_cache
    from helpers.inference.serving import Request, serve
    from helpers.model.attention import AttentionBackend

    calls = []

    class Float64Attention(AttentionBackend):
        name, description = "float64_toy", "softmax(QK^T)V in float64, cast back (a test's backend)"
        masked = True

        @staticmethod
        def kernel(q, k, v, dropout_p=0.0, attn_mask=None, is_causal=True):
            calls.append((q.size(-2), k.size(-2), is_causal))
            return float64_attention(q, k, v, dropout_p, attn_mask, is_causal)

        def limits(self, call):
            return "this toy has no backward pass" if call.backward else None

    with registered(Float64Attention):
        toy, reference, idx = toy_and_reference("float64_toy")
        with torch.no_grad():
            torch.testing.assert_close(toy(idx), reference(idx), rtol=1e-5, atol=1e-5)
            expected = reference.generate(idx, 6)
            calls.clear()
            assert torch.equal(generate_with_cache(toy, idx, 6), expected)
            assert (9, 9, True) in calls and (1, 14, False) in calls  # the prompt, then one token over the cache
            calls.clear()
            run = serve(toy, [Request(i, tuple(row.tolist()), 6) for i, row in enumerate(idx)], max_batch=2,
                        block_size=4)
            assert (9, 9, True) in calls and (1, 14, False) in calls  # prefill, then the last token over 14 cached
            calls.clear()
            assert torch.equal(CompiledDecoder(toy, 2, 15, compile=False).generate(idx, 6), expected)
            assert calls == [(9, 15, False)] * TOY.n_layers  # the prompt over the static cache; decode steps attend
            # with decode_attention, the default over a static cache for a backend without its own cached kernel
        assert [list(idx[i]) + c.tokens for i, c in enumerate(run.completions)] == expected.tolist()
        with pytest.raises(RuntimeError, match="'float64_toy' cannot run here: this toy has no backward pass"):
            toy.train()(idx)


def own_cached_kernel_backend(calls):
    """A backend that brings its own kernel for attention over a KV cache, whatever the cache: float64 attention over
    what the cache holds for each read (`kv.read`: through a paged cache's slots, an int8 cache dequantized), with the
    cache's mask or the causal rule from `kv.start`; each call recorded in `calls` as (which cache, queries). Its
    kernel for attention without a cache takes no mask (`masked` stays False): its own `attend` serves the caches."""
    from helpers.model.attention import AttentionBackend, causal_from

    class OwnCachedKernel(AttentionBackend):
        name, description = "own_cached_toy", "its own float64 attention over a KV cache (a test's backend)"
        supports_dropout = False

        @staticmethod
        def kernel(q, k, v, dropout_p=0.0):
            return float64_attention(q, k, v)

        def attend(self, q, kv):
            keys, values = kv.read(torch.float64)
            allowed = kv.allowed if kv.allowed is not None else causal_from(kv.start, q.size(2), q.device)
            held = "paged" if isinstance(kv.slots, torch.Tensor) else "static" if kv.static else "contiguous"
            calls.append((held, q.size(2)))
            return float64_attention(q, keys, values, attn_mask=allowed, is_causal=False)

    return OwnCachedKernel


def test_a_backend_with_its_own_cached_kernel_is_one_class_for_every_cache():
    """The eager KV cache (in the compute dtype and in int8), the paged engine and the compiled decoder's static cache
    all attend through the backend's own `attend`: the tokens of the model on SDPA, and its calls seen."""
    from helpers.inference.compiled_decode import CompiledDecoder
    from helpers.inference.kv_cache import generate_with_cache
    from helpers.inference.serving import Request, serve
    from helpers.model.attention import AttentionBackend

    calls = []
    backend = own_cached_kernel_backend(calls)
    with registered(backend):
        toy, reference, idx = toy_and_reference("own_cached_toy", torch.float64)
        with torch.no_grad():
            expected = reference.generate(idx, 6)
            assert torch.equal(generate_with_cache(toy, idx, 6), expected)
            assert {("contiguous", 9), ("contiguous", 1)} == set(calls)
            int8 = generate_with_cache(reference, idx, 6, kv_cache_dtype="int8")
            assert torch.equal(generate_with_cache(toy, idx, 6, kv_cache_dtype="int8"), int8)
            calls.clear()
            run = serve(toy, [Request(i, tuple(row.tolist()), 6) for i, row in enumerate(idx)], max_batch=2,
                        block_size=4)
            assert [list(idx[i]) + c.tokens for i, c in enumerate(run.completions)] == expected.tolist()
            assert {("paged", 9), ("paged", 1)} == set(calls)  # the prompts' chunks, the decoding tokens batched
            calls.clear()
            assert torch.equal(CompiledDecoder(toy, 2, 15, compile=False).generate(idx, 6), expected)
            assert {("static", 9), ("static", 1)} == set(calls)
        cached = AttentionCall("cpu", torch.float64, cached=True)
        assert unavailable_reason("own_cached_toy", cached) is None

        class WithoutItsAttend(backend):  # the same kernel, which takes no mask, and the default `attend`
            attend = AttentionBackend.attend

        assert "a KV cache needs new queries against every cached key" in WithoutItsAttend().unavailable_reason(cached)


@pytest.mark.compile
def test_the_compiled_decoder_attends_with_the_models_backend_from_the_registry():
    """Compiled, the decode step is traced through the backend's own `attend` (one query over the static cache) and
    gives the tokens of the model on SDPA."""
    from helpers.inference.compiled_decode import CompiledDecoder

    calls = []
    torch.compiler.reset()
    with registered(own_cached_kernel_backend(calls)):
        toy, reference, idx = toy_and_reference("own_cached_toy", torch.float64)
        decoder = CompiledDecoder(toy, 2, 15)
        assert torch.equal(decoder.generate(idx, 6), reference.generate(idx, 6))
        assert ("static", 1) in calls


def test_a_backend_the_forward_pass_cannot_use_is_refused_when_registered():
    from helpers.model.attention import AttentionBackend, register

    class Nameless(AttentionBackend):
        kernel = staticmethod(lambda q, k, v, dropout_p=0.0: q)

    with pytest.raises(TypeError, match="needs a name and exactly one of `kernel` and `layout`"):
        register(Nameless)
    assert "" not in IMPLEMENTATIONS
