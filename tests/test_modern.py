"""Chapter 8's modern decoder against references: RoPE against complex rotation in float64, grouped-query attention
(with RoPE and QK-norm) against a float64 attention written out head by head, forward and gradients, for every
kernel; Llama and Qwen3 weights against transformers; the KV cache and the serving engine against uncached decoding.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import GPT, GPTConfig
from helpers.inference.kv_cache import KVCache, generate_with_cache, kv_cache_bytes_per_token
from helpers.inference.serving import Request, serve
from helpers.measure import attention_bench
from helpers.measure.attention_bench import grouped_attention_kernel, sdpa_backend_used
from helpers.measure.flops import flop_counter_flops, forward_flops, fvcore_flops
from helpers.measure.serving_bench import reference_tokens
from helpers.model import attention
from helpers.model.attention import IMPLEMENTATIONS, AttentionCall, CausalSelfAttention, unavailable_reason
from helpers.model.hf_files import WeightsError
from helpers.model.hf_gpt2 import save_hf_gpt2
from helpers.model.hf_llama import config_from_hf, load_hf_llama, save_hf_llama
from helpers.model.rope import apply_rope, rope_angles
from helpers.parallel.tensor_parallel import check_tensor_parallel

# ---- RoPE ----


def rotate_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Pairs (i, i + d/2) as complex numbers, each multiplied by exp(1j * position * theta^(-2i/d)), in float64."""
    half = x.size(-1) // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.size(-1))
    z = z * torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions.double()[:, None] * freqs)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("head_dim, theta", [(8, 10000.0), (24, 500.0), (128, 1e6)])
def test_rope_is_the_complex_rotation(head_dim, theta):
    x = torch.randn(2, 3, 41, head_dim)
    positions = torch.arange(100, 141)
    cos, sin = rope_angles(positions, head_dim, theta)
    torch.testing.assert_close(apply_rope(x, cos, sin).double(), rotate_complex(x, positions, theta),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths


def test_rope_scores_depend_on_relative_position_only():
    q, k = torch.randn(16), torch.randn(16)

    def score(m, n):
        (cq, sq), (ck, sk) = (rope_angles(torch.tensor([p]), 16, 10000.0) for p in (m, n))
        return (apply_rope(q, cq[0], sq[0]) * apply_rope(k, ck[0], sk[0])).sum()

    for shift in (1, 17, 200):
        torch.testing.assert_close(score(5 + shift, 2 + shift), score(5, 2), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)


# ---- attention with GQA, RoPE and QK-norm against float64 ----


def reference_attention(x, wq, wk, wv, wo, heads, kv_heads, theta, q_norm=None, k_norm=None, eps=1e-5):
    """Every query head h against key/value head h // (heads / kv_heads), written out one head at a time."""
    batch, seq, _ = x.shape
    q = (x @ wq.T).view(batch, seq, heads, -1).transpose(1, 2)
    k, v = ((x @ w.T).view(batch, seq, kv_heads, -1).transpose(1, 2) for w in (wk, wv))
    if q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * q_norm
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm
    positions = torch.arange(seq)
    q, k = rotate_complex(q, positions, theta), rotate_complex(k, positions, theta)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    outputs = []
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = (q[:, h] @ k[:, kv].transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(future, float("-inf"))
        outputs.append(torch.softmax(scores, dim=-1) @ v[:, kv])
    return torch.cat(outputs, dim=-1) @ wo.T


KERNELS = [name for name, impl in IMPLEMENTATIONS.items() if impl.kernel is not None]
# (batch, seq, d_model, heads, kv_heads, head_dim, qk_norm): MQA at seq 1, GQA at odd lengths, heads wider than
# d_model / heads (Qwen3-style), MHA with QK-norm
SHAPES = [(1, 1, 32, 4, 1, 8, False), (2, 37, 48, 6, 2, 8, True), (1, 67, 32, 4, 2, 16, True),
          (3, 29, 40, 4, 4, 10, False)]


def modern_case(name, shape, requires_grad):
    batch, seq, d_model, heads, kv_heads, head_dim, qk_norm = shape
    reason = unavailable_reason(name, AttentionCall("cpu", torch.float32, backward=requires_grad, modern=True))
    if reason:
        pytest.skip(f"{name}: {reason}")
    torch.manual_seed(0)
    module = CausalSelfAttention(d_model, heads, bias=False, attn_implementation=name, n_kv_heads=kv_heads,
                                 head_dim=head_dim, qk_norm=qk_norm)
    if qk_norm:  # away from 1, so a missing norm weight shows
        with torch.no_grad():
            module.q_norm.weight.uniform_(0.5, 1.5)
            module.k_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(batch, seq, d_model, requires_grad=requires_grad)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    wq, wk, wv = module.qkv.weight.split([q_width, kv_width, kv_width])
    norms = [module.q_norm.weight, module.k_norm.weight] if qk_norm else []
    ref = [t.detach().double().requires_grad_(requires_grad) for t in (x, wq, wk, wv, module.out_proj.weight, *norms)]
    rope = rope_angles(torch.arange(seq), head_dim, 10000.0)
    return module, x, rope, ref, heads, kv_heads


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", KERNELS)
def test_modern_attention_forward_and_gradients_match_float64(name, shape):
    forward_only = unavailable_reason(name, AttentionCall("cpu", torch.float32, backward=True, modern=True)) is not None
    module, x, rope, ref, heads, kv_heads = modern_case(name, shape, requires_grad=not forward_only)
    with torch.set_grad_enabled(not forward_only):
        out = module(x, rope=rope)
    expected = reference_attention(*ref[:5], heads, kv_heads, 10000.0, *ref[5:])
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-5)
    if forward_only:
        return
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out.double())
    q_width = heads * module.head_dim
    kv_width = kv_heads * module.head_dim
    ours = [x.grad, *module.qkv.weight.grad.split([q_width, kv_width, kv_width]), module.out_proj.weight.grad]
    if module.q_norm is not None:
        ours += [module.q_norm.weight.grad, module.k_norm.weight.grad]
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got.double(), want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n, impl in IMPLEMENTATIONS.items() if impl.layout is not None])
def test_gpt2_layouts_refuse_modern_attention_and_name_the_kernels(name):
    module = CausalSelfAttention(32, 4, attn_implementation=name, n_kv_heads=2)
    refusal = f"'{name}' cannot run here: .*without GQA, RoPE or QK-norm: use one of eager"
    with pytest.raises(RuntimeError, match=refusal):
        module(torch.randn(1, 5, 32))


# ---- the configuration and the model ----


@pytest.mark.parametrize("change, message", [
    ({"n_kv_heads": 3, "n_heads": 8}, "must divide n_heads"),
    ({"norm": "batchnorm"}, "unknown GPTConfig.norm 'batchnorm'; valid types: layernorm, rmsnorm"),
    ({"position_encoding": "alibi"}, "valid types: learned, rope"),
    ({"position_encoding": "rope", "head_size": 7}, "head_dim must be even"),
    ({"rope_theta": 0.0}, "must be positive"),
    ({"n_kv_heads": 0}, "n_kv_heads must be a positive integer"),
])
def test_bad_modern_options_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig.from_preset("gpt-smoke", **change)


def test_gpt2_presets_are_unchanged_and_llama_style_drops_the_position_table():
    gpt2 = GPT(GPTConfig.from_preset("gpt2-small", vocab_size=50257), attn_implementation="sdpa")
    assert gpt2.num_parameters() == 124_439_808  # GPT-2 small, as published
    llama = GPT(GPTConfig.from_preset("llama-smoke"))
    assert llama.pos_emb is None and llama.lm_head.weight is not llama.tok_emb.weight
    assert all(isinstance(m, torch.nn.RMSNorm) for m in (llama.ln_f, llama.blocks[0].ln1))
    assert not any(n.endswith(".bias") for n, _ in llama.named_parameters())


def test_gqa_quarters_the_kv_cache():
    mha = GPTConfig.from_preset("gpt-smoke", n_heads=8)
    gqa = GPTConfig.from_preset("gpt-smoke", n_heads=8, n_kv_heads=2)
    assert kv_cache_bytes_per_token(gqa) * 4 == kv_cache_bytes_per_token(mha) == 2 * 2 * 128 * 4
    assert KVCache(gqa, 3, 20).nbytes * 4 == KVCache(mha, 3, 20).nbytes


MODERN = GPTConfig(vocab_size=97, context_length=48, d_model=48, n_heads=6, n_layers=2, dropout=0.0, n_kv_heads=2,
                   head_size=10, qk_norm=True, norm="rmsnorm", position_encoding="rope", ffn_type="swiglu",
                   bias=False, tie_weights=False, rope_theta=500.0)


@pytest.fixture(scope="module")
def modern64():
    torch.manual_seed(0)
    return GPT(MODERN).double().eval()


@pytest.mark.parametrize("name", ["eager", "sdpa", "sdpa_mask"])
def test_cached_decoding_is_token_identical_to_uncached(modern64, name):
    model = modern64.set_attn_implementation(name)
    prompt = torch.randint(0, 97, (3, 7), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate_with_cache(model, prompt, 30), model.generate(prompt, 30))
    model.set_attn_implementation("sdpa")


def test_serving_engine_is_token_identical_to_uncached(modern64):
    g = torch.Generator().manual_seed(2)
    requests = [Request(f"r{i}", tuple(torch.randint(0, 97, (int(n),), generator=g).tolist()), int(m))
                for i, (n, m) in enumerate(zip(torch.randint(1, 20, (7,), generator=g),
                                               torch.randint(1, 16, (7,), generator=g), strict=True))]
    run = serve(modern64, requests, max_batch=3, block_size=4, max_step_tokens=9)
    assert {c.request_id: c.tokens for c in run.completions} == {r.request_id: reference_tokens(modern64, r)
                                                                for r in requests}


@pytest.mark.parametrize("name", ["sdpa", "sdpa_mask"])
def test_grouped_heads_are_copied_where_no_fused_kernel_shares_them(modern64, name, monkeypatch):
    """On a GPU without a fused kernel for grouped heads (a T4; a masked call) SDPA would run its math kernel: the
    heads are copied instead, so the memory-efficient one can. Same logits and tokens as sharing them, in float64."""
    sdpa, heads = F.scaled_dot_product_attention, []

    def recording(q, k, v, *args, **kwargs):
        heads.append(k.size(1))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = modern64.set_attn_implementation(name)
    prompt = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, tokens = model(prompt), generate_with_cache(model, prompt, 12)
    shared, heads[:] = set(heads), []
    monkeypatch.setattr(attention, "fused_kernel_shares_kv_heads", lambda *args: False)
    with torch.no_grad():
        logits_copied, tokens_copied = model(prompt), generate_with_cache(model, prompt, 12)
    model.set_attn_implementation("sdpa")
    assert shared == {MODERN.kv_heads} and set(heads) == {MODERN.n_heads}
    assert torch.allclose(logits_copied, logits, rtol=0, atol=1e-12) and torch.equal(tokens_copied, tokens)


def test_on_the_cpu_grouped_heads_stay_shared_and_the_kernel_is_named(monkeypatch):
    """PyTorch's CPU kernels take grouped heads (flash in recent releases, math in torch 2.8); the report names the
    kernel SDPA dispatched to, and says when the heads were copied."""
    q, k = torch.randn(2, 6, 16, 8), torch.randn(2, 2, 16, 8)
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    cpu = torch.device("cpu")
    for kwargs, queries in ((dict(is_causal=True), None), (dict(attn_mask=mask), 16)):
        assert attention.fused_kernel_shares_kv_heads(q, k, k, kwargs.get("attn_mask"), 0.0, "is_causal" in kwargs)
        kernel = sdpa_backend_used(q, k, k, enable_gqa=True, **kwargs)
        assert grouped_attention_kernel(MODERN, 2, 16, torch.float32, cpu, queries).split(",")[0] == kernel
    assert grouped_attention_kernel(MODERN, 2, 16, torch.float32, cpu, 1).endswith("shared in the kernel")
    mha = GPTConfig.from_preset("gpt-smoke")
    assert grouped_attention_kernel(mha, 1, 16, torch.float32, cpu) == sdpa_backend_used(
        *(torch.zeros(1, mha.n_heads, 16, mha.head_dim),) * 3, is_causal=True)
    monkeypatch.setattr(attention_bench, "fused_kernel_shares_kv_heads", lambda *args: False)
    assert grouped_attention_kernel(MODERN, 2, 16, torch.float32, cpu).endswith("copied to every query head")


def test_flop_counters_agree_with_the_analytic_count():
    for config in (GPTConfig.from_preset("llama-cpu"), MODERN):
        analytic = forward_flops(config, 2, 32).total()
        for counted in (fvcore_flops(config, 2, 32), flop_counter_flops(config, 2, 32)):
            assert abs(counted.total / analytic - 1) < 0.01, (counted.counter, counted.total, analytic)
    wide, narrow = (forward_flops(GPTConfig.from_preset("gpt-smoke", n_kv_heads=kv), 1, 64) for kv in (4, 1))
    assert wide.qkv - narrow.qkv == 2 * 64 * 2 * 2 * 128 * (4 - 1) * 32  # layers·tokens·2·d·(K and V heads saved)·hd
    assert wide.attention() == narrow.attention()  # every query head still attends


def test_tensor_parallelism_refuses_gqa():
    with pytest.raises(ValueError, match="grouped-query attention"):
        check_tensor_parallel(GPT(GPTConfig.from_preset("llama-smoke")), 2)


# ---- Llama and Qwen3 weights against transformers ----


def hf_model(kind: str, tie: bool = False):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=101, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500.0,
                  tie_word_embeddings=tie)
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**common, head_dim=10), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # norms away from 1, so a norm loaded in the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_a_tied_checkpoint_loads_with_one_matrix_for_embedding_and_head(tmp_path):
    """Small Qwen3 models tie the head (no lm_head.weight in the file); the loader assigned the embedding and
    then found the head still unfilled."""
    theirs = hf_model("qwen3", tie=True)
    theirs.save_pretrained(tmp_path)
    ours = load_hf_llama(tmp_path)
    assert ours.config.tie_weights and ours.lm_head.weight is ours.tok_emb.weight
    idx = torch.randint(0, 101, (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_checkpoint_gives_transformers_logits_and_tokens(kind, tmp_path):
    theirs = hf_model(kind)
    theirs.save_pretrained(tmp_path)
    ours = load_hf_llama(tmp_path)
    assert ours.config.qk_norm == (kind == "qwen3") and ours.config.kv_heads == 2
    idx = torch.randint(0, 101, (2, 23))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=1e-4, atol=1e-5)
        want = theirs.generate(idx[:1, :5], max_new_tokens=12, do_sample=False, min_new_tokens=12)
    assert torch.equal(generate_with_cache(ours, idx[:1, :5], 12), want)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_export_loads_into_transformers_with_the_same_logits(kind, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = GPT(GPTConfig.from_preset("llama-smoke", vocab_size=101, qk_norm=kind == "qwen3", head_size=24)).eval()
    save_hf_llama(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == kind
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 101, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=1e-4, atol=1e-5)
    again = load_hf_llama(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


def test_bad_llama_checkpoints_are_refused_by_name(tmp_path):
    hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for change, message in (({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type 'llama3'"),
                            ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
                            ({"model_type": "mistral"}, "model_type 'mistral'")):
        with pytest.raises(WeightsError, match=message):
            config_from_hf(config | change)
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 1}))
    with pytest.raises(WeightsError, match="has 9 tensor.* e.g. 'model.layers.1"):
        load_hf_llama(tmp_path)
    with pytest.raises(WeightsError, match="is not a folder"):
        load_hf_llama(tmp_path / "missing")


def test_each_layout_refuses_the_other_architecture(tmp_path):
    with pytest.raises(WeightsError, match="Llama/Qwen3 layout needs RMSNorm"):
        save_hf_llama(GPT(GPTConfig.from_preset("gpt-smoke")), tmp_path)
    with pytest.raises(WeightsError, match="save it in the Llama layout"):
        save_hf_gpt2(GPT(GPTConfig.from_preset("llama-smoke")), tmp_path)
