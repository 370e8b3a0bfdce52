"""The GPT against PyTorch's own transformer layers, and generation behaviour."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import GPT, GPTConfig
from helpers.model.attention import CausalSelfAttention
from helpers.model.decoding import Sampling
from helpers.model.feed_forward import FeedForward, SwiGLUFeedForward, swiglu_hidden_dim

TINY = GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=2, dropout=0.0)


def causal_mask(seq):
    return torch.ones(seq, seq, dtype=torch.bool).triu(1)


def reference_layer(block) -> nn.TransformerEncoderLayer:
    """PyTorch's pre-LN encoder layer (causal mask = a decoder block) with the block's weights."""
    d = block.ln1.normalized_shape[0]
    layer = nn.TransformerEncoderLayer(
        d, block.attn.n_heads, dim_feedforward=block.mlp.fc.out_features, dropout=0.0,
        activation=lambda x: F.gelu(x, approximate="tanh"), batch_first=True, norm_first=True,
        dtype=torch.float64,
    )
    with torch.no_grad():
        layer.self_attn.in_proj_weight.copy_(block.attn.qkv.weight)
        layer.self_attn.in_proj_bias.copy_(block.attn.qkv.bias)
        layer.self_attn.out_proj.weight.copy_(block.attn.out_proj.weight)
        layer.self_attn.out_proj.bias.copy_(block.attn.out_proj.bias)
        for ours, theirs in ((block.ln1, layer.norm1), (block.ln2, layer.norm2),
                             (block.mlp.fc, layer.linear1), (block.mlp.proj, layer.linear2)):
            theirs.weight.copy_(ours.weight)
            theirs.bias.copy_(ours.bias)
    return layer.eval()


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize(("batch", "seq"), [(1, 1), (2, 7), (3, 32)])
def test_logits_match_pytorch_transformer_layers(attn_implementation, batch, seq):
    torch.manual_seed(0)
    model = GPT(TINY, attn_implementation=attn_implementation).double().eval()
    idx = torch.randint(0, TINY.vocab_size, (batch, seq))
    x = model.tok_emb.weight[idx] + model.pos_emb.weight[:seq]
    for block in model.blocks:
        x = reference_layer(block)(x, src_mask=causal_mask(seq))
    ln_f = model.ln_f
    expected = F.layer_norm(x, (TINY.d_model,), ln_f.weight, ln_f.bias) @ model.tok_emb.weight.T
    torch.testing.assert_close(model(idx), expected, rtol=1e-10, atol=1e-10)


def test_attention_matches_nn_multihead_attention_with_gradients():
    torch.manual_seed(0)
    ours = CausalSelfAttention(48, 4, attn_implementation="eager").double()
    ref = nn.MultiheadAttention(48, 4, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv.weight)
        ref.in_proj_bias.copy_(ours.qkv.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
    x = torch.randn(2, 11, 48, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = ours(x)
    y_ref = ref(x_ref, x_ref, x_ref, attn_mask=causal_mask(11), need_weights=False)[0]
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(ours.qkv.weight.grad, ref.in_proj_weight.grad)


def test_eager_and_sdpa_agree_in_float32_and_switch_in_place():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (2, 32))
    sdpa = model(idx)
    assert model.set_attn_implementation("eager").attn_implementation == "eager"
    torch.testing.assert_close(model(idx), sdpa, rtol=1e-5, atol=1e-5)


def test_causality_future_tokens_do_not_change_past_logits():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = torch.randint(0, TINY.vocab_size, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])


def test_unknown_attention_and_context_overflow_are_clear_errors():
    with pytest.raises(ValueError, match="valid names: wrapper, stacked, eager"):
        GPT(TINY, attn_implementation="flash")
    with pytest.raises(ValueError, match="context length is 32"):
        GPT(TINY)(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("bad, where", [(97, (0, 2)), (-1, (1, 0)), (10**6, (1, 3))])
def test_token_ids_outside_the_vocabulary_are_named(bad, where):
    model = GPT(TINY)
    idx = torch.zeros(2, 4, dtype=torch.long)
    idx[where] = bad
    message = re.escape(f"token id {bad} at index {where} is outside the vocabulary [0, 97)")
    with pytest.raises(ValueError, match=message):
        model(idx)
    with pytest.raises(ValueError, match=message):
        model.generate(idx, 2)
    with pytest.raises(ValueError, match="token ids must be integers"):
        model(idx.float())


def test_the_token_id_check_leaves_fake_tensors_alone():
    """FLOP counting runs the model on fake tensors, whose values cannot be read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert GPT(TINY)(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, TINY.vocab_size)


def test_greedy_generation_equals_argmax_loop():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    prompt = torch.randint(0, TINY.vocab_size, (2, 5))
    expected = prompt
    for _ in range(6):
        expected = torch.cat([expected, model(expected)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(model.generate(prompt, 6), expected)


def test_generation_past_the_context_uses_a_sliding_window():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    prompt = torch.randint(0, TINY.vocab_size, (1, 30))
    out = model.generate(prompt, 5)
    assert out.shape == (1, 35)
    last = model(out[:, -33:-1])[:, -1].argmax(-1)  # the final token saw the last 32 tokens
    assert out[0, -1] == last[0]


def test_sampling_is_seeded_and_top_k_restricts_the_choice():
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    prompt = torch.randint(0, TINY.vocab_size, (4, 3))

    def sample(**kw):
        return model.generate(prompt, 8, Sampling(**kw), torch.Generator().manual_seed(7))

    assert torch.equal(sample(temperature=1.0), sample(temperature=1.0))
    assert torch.equal(sample(temperature=1.0, top_k=1), model.generate(prompt, 8))
    out = sample(temperature=2.0, top_k=3)
    for t in range(3, out.size(1)):
        top3 = model(out[:, :t])[:, -1].topk(3).indices
        assert (top3 == out[:, t : t + 1]).any(dim=1).all()


def test_generation_restores_training_mode_and_rejects_bad_arguments():
    model = GPT(TINY).train()
    model.generate(torch.zeros(1, 1, dtype=torch.long), 1)
    assert model.training
    with pytest.raises(ValueError, match="prompt has 33 tokens but the context length is 32"):
        model.generate(torch.zeros(1, 33, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="top_k must be an integer in"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, Sampling(temperature=1.0, top_k=0))
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), -1)
    with pytest.raises(TypeError, match="prompts of different lengths"):
        model.generate([[1, 2], [3]], 1)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, Sampling(temperature=-1.0))
    with pytest.raises(TypeError, match="sampling must be a helpers.model.decoding.Sampling"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, 0.8)  # a temperature where the Sampling goes


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_dropout_acts_in_training_only(attn_implementation):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(TINY, dropout=0.2), attn_implementation=attn_implementation)
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    assert not torch.equal(model.train()(idx), model(idx))
    assert torch.equal(model.eval()(idx), model(idx))


@pytest.mark.parametrize("d_model", [48, 64, 100, 128, 256, 384, 768, 1024, 1280, 1600, 2048, 4096])
def test_swiglu_feed_forward_has_the_gelu_mlps_parameter_count(d_model):
    config = GPTConfig(d_model=d_model, n_heads=1, ffn_type="swiglu")
    with torch.device("meta"):
        gelu, swiglu = FeedForward(config), SwiGLUFeedForward(config)
    count = [sum(p.numel() for p in m.parameters()) for m in (gelu, swiglu)]
    assert count[1] == pytest.approx(count[0], rel=0.01)
    if d_model >= 384:  # the GPT-2 sizes and up: a matmul-friendly multiple of 64
        assert swiglu_hidden_dim(d_model) % 64 == 0


def test_swiglu_matches_a_float64_reference_with_gradients():
    torch.manual_seed(0)
    ff = SwiGLUFeedForward(GPTConfig(d_model=48, n_heads=4, dropout=0.0, ffn_type="swiglu"))
    hidden = ff.proj.in_features
    x = torch.randn(2, 5, 48, dtype=torch.float64, requires_grad=True)
    w, b = ff.fc.weight.double(), ff.fc.bias.double()
    gate, up = x @ w[:hidden].T + b[:hidden], x @ w[hidden:].T + b[hidden:]
    expected = (gate / (1 + torch.exp(-gate)) * up) @ ff.proj.weight.double().T + ff.proj.bias.double()
    torch.testing.assert_close(ff(x.float()).double(), expected, rtol=1e-5, atol=1e-6)  # float32 module
    y = ff.double()(x)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    grad_out = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, grad_out)
    (dx_ref,) = torch.autograd.grad(expected, x, grad_out)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-12, atol=1e-12)


def test_gpt_with_swiglu_is_causal_and_scales_its_residual_projection():
    torch.manual_seed(0)
    config = dataclasses.replace(TINY, n_layers=8, ffn_type="swiglu")
    model = GPT(config).eval()
    assert isinstance(model.blocks[0].mlp, SwiGLUFeedForward)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.1)  # 0.02 / sqrt(2 * 8)
    idx = torch.randint(0, config.vocab_size, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % config.vocab_size
    torch.testing.assert_close(model(idx)[:, :10], model(changed)[:, :10])
