"""Int8 quantization against float64 references, with error bounds derived from the scales; torchao against ours."""

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from helpers import GPT, GPTConfig
from helpers.inference.quantization import (
    Int8Embedding,
    Int8Linear,
    dequantize_per_channel,
    import_torchao,
    quantize_linears,
    quantize_per_channel,
    saved_bytes,
    tie_int8_embedding,
    torchao_quantize,
)
from helpers.system.optional import ExpectedLibraryLogs, version_of

TINY = GPTConfig(vocab_size=211, context_length=32, d_model=64, n_heads=4, n_layers=2, dropout=0.0)
needs_torchao = pytest.mark.skipif(version_of("torchao") is None,
                                   reason="torchao is not installed (`pip install torchao`): its path is not compared")


def weights_with_varied_rows(rows=48, cols=80, seed=0) -> torch.Tensor:
    """Rows whose magnitudes span four orders, one outlier, and an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0 ** torch.empty(rows, 1).uniform_(-3, 1, generator=g)
    w[3, 7] = 50.0
    w[5] = 0.0
    return w


def model_for(config=TINY, seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config).eval()


def test_round_trip_error_is_at_most_half_a_scale_step_per_row():
    w = weights_with_varied_rows()
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (w.shape[0],)
    assert q.abs().max() <= 127
    w64, s64 = w.double(), scale.double()
    torch.testing.assert_close(s64, torch.where(w64.abs().amax(1) > 0, w64.abs().amax(1) / 127, 1.0), rtol=1e-6, atol=0)
    err = (w64 - q.double() * s64[:, None]).abs()  # float64 reference of the dequantized weights
    assert torch.all(err <= s64[:, None] / 2 * (1 + 1e-6))
    nonzero = w.abs().amax(1) > 0
    assert torch.all(q[nonzero].abs().amax(1) == 127)  # each row uses the full range
    assert torch.all(q[5] == 0)
    torch.testing.assert_close(dequantize_per_channel(q, scale).double(), q.double() * s64[:, None])


def test_per_channel_scales_keep_small_rows_precise():
    """A per-tensor scale would be set by the outlier and round the smallest rows to zero."""
    w = weights_with_varied_rows()
    q, _ = quantize_per_channel(w)
    per_tensor_step = w.abs().max() / 127
    small = w.abs().amax(1) < per_tensor_step / 2
    assert small.any()
    assert torch.all(torch.round(w[small] / per_tensor_step) == 0)
    assert torch.all(q[small & (w.abs().amax(1) > 0)].abs().amax(1) == 127)


def linear_error_bound(x, w, w_scale, mode):
    """|x·W^T - Int8Linear(x)| per output: each weight is off by <= s_o/2 (weight-only); with dynamic
    activations, each input by <= s_x/2 = max|x_row|/254 too, times the dequantized weights' row sums."""
    x64 = x.double().reshape(-1, x.shape[-1])
    bound = x64.abs().sum(1, keepdim=True) * w_scale.double()[None, :] / 2
    if mode == "dynamic":
        deq_row_sums = w.double().abs().sum(1) + w.shape[1] * w_scale.double() / 2  # sum_j |deq(W)_oj| at most
        bound = bound + (x64.abs().amax(1, keepdim=True) / 254) * deq_row_sums[None, :]
    rounding = 1e-5 * (x64.abs() @ w.double().abs().T) + 1e-6  # float32 arithmetic
    return (bound + rounding).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_within_the_scale_bound_of_the_float64_reference(mode, bias):
    torch.manual_seed(0)
    linear = nn.Linear(80, 48, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(weights_with_varied_rows())
    x = torch.randn(5, 3, 80)
    q = Int8Linear.from_linear(linear, mode)
    assert q.weight_int8.dtype == torch.int8
    with torch.no_grad():
        got = q(x)
    b = 0 if linear.bias is None else linear.bias.double()
    expected = x.double() @ linear.weight.double().T + b
    err = (got.double() - expected).abs()
    assert torch.all(err <= linear_error_bound(x, linear.weight.detach(), q.scale, mode))
    assert err.max() > 0  # the weights really were rounded
    if mode == "weight_only":  # exactly x @ dequantized(W)^T, up to float32 rounding
        deq = q.weight_int8.double() * q.scale.double()[:, None]
        torch.testing.assert_close(got.double(), x.double() @ deq.T + b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
def test_quantized_gpt_logits_close_to_the_float_model(mode):
    model = model_for()
    idx = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    quantized = quantize_linears(copy.deepcopy(model), mode)
    assert all(not isinstance(m, nn.Linear) for m in quantized.modules())
    with torch.no_grad():
        ref, got = model(idx).double(), quantized(idx).double()
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    if mode == "weight_only":  # the same as a float64 model whose weights are the dequantized ones
        reference = copy.deepcopy(model).double()
        reference.lm_head = nn.Linear(TINY.d_model, TINY.vocab_size, bias=False).double()
        for name, module in quantized.named_modules():
            if isinstance(module, Int8Linear):
                reference.get_submodule(name).weight.data = module.weight_int8.double() * module.scale.double()[:, None]
        with torch.no_grad():
            torch.testing.assert_close(got, reference(idx), rtol=1e-4, atol=1e-5)


def test_linear_weights_shrink_more_than_three_times():
    config = GPTConfig.from_preset("gpt-smoke")
    model = model_for(config)
    float_bytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, nn.Linear))
    quantized = quantize_linears(copy.deepcopy(model))
    int8_bytes = sum(m.weight_int8.nbytes + m.scale.nbytes for m in quantized.modules() if isinstance(m, Int8Linear))
    assert float_bytes / int8_bytes > 3
    params = sum(p.nbytes for p in model.parameters())  # parameters() yields the tied matrix once
    assert params <= saved_bytes(model) <= params * 1.02 + 65536  # the file is the tensors plus a small index


def test_quantizing_the_lm_head_unties_it_and_tie_int8_embedding_reties_it():
    model = model_for()
    emb_bytes = model.tok_emb.weight.nbytes
    skipped = quantize_linears(copy.deepcopy(model), skip=("lm_head",))
    assert skipped.lm_head.weight is skipped.tok_emb.weight  # still tied, still float
    untied = quantize_linears(copy.deepcopy(model))
    assert isinstance(untied.lm_head, Int8Linear) and isinstance(untied.tok_emb, nn.Embedding)
    head_int8 = untied.lm_head.weight_int8.nbytes + untied.lm_head.scale.nbytes
    untied_bytes = saved_bytes(untied)
    assert untied_bytes - saved_bytes(skipped) == pytest.approx(head_int8, abs=4096)
    tied = tie_int8_embedding(untied)
    assert isinstance(tied.tok_emb, Int8Embedding)
    assert tied.tok_emb.weight_int8.data_ptr() == tied.lm_head.weight_int8.data_ptr()
    assert untied_bytes - saved_bytes(tied) == pytest.approx(emb_bytes, abs=4096)
    idx = torch.tensor([[0, 5, 210, 5]])
    torch.testing.assert_close(tied.tok_emb(idx), tied.lm_head.weight[idx])  # rows of the dequantized table
    assert ((tied.tok_emb(idx) - model.tok_emb(idx)).abs() <= tied.lm_head.scale[idx][..., None] / 2 + 1e-7).all()


def test_bad_input_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="floating-point matrix"):
        quantize_per_channel(torch.randn(5))
    with pytest.raises(ValueError, match="floating-point matrix"):
        quantize_per_channel(torch.ones(2, 2, dtype=torch.int8))
    with pytest.raises(ValueError, match="unknown mode"):
        Int8Linear.from_linear(nn.Linear(4, 4), mode="int4")
    with pytest.raises(ValueError, match="unknown mode"):
        quantize_linears(model_for(), mode="int4")
    with pytest.raises(ValueError, match="skip names no Linear"):
        quantize_linears(model_for(), skip=("head",))
    with pytest.raises(ValueError, match="quantize the LM head first"):
        tie_int8_embedding(quantize_linears(model_for(), skip=("lm_head",)))
    with pytest.raises(ValueError, match="tie_weights=False"):
        tie_int8_embedding(quantize_linears(model_for(dataclasses.replace(TINY, tie_weights=False))))
    with pytest.raises(RuntimeError, match="runs on CPU"):
        Int8Linear.from_linear(nn.Linear(4, 4), mode="dynamic")(torch.empty(2, 4, device="meta"))
    with pytest.raises(ValueError, match="unknown mode"):
        torchao_quantize(model_for(), mode="int4")


@pytest.mark.parametrize("cuda_version", [None, "12.8"])
def test_log_filter_drops_only_the_expected_torchao_lines(monkeypatch, cuda_version):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    log_filter = ExpectedLibraryLogs()

    def kept(message):
        return log_filter.filter(logging.LogRecord("torchao", logging.WARNING, __file__, 1, message, None, None))

    expected = [
        "Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated",
    ]
    assert all(kept(m) == (cuda_version is not None) for m in expected)
    assert kept("Skipping import of cpp extensions due to incompatible torch version")
    assert kept("Failed to quantize layer blocks.0.attn.qkv")


@needs_torchao
@pytest.mark.parametrize("mode", ["weight_only", "dynamic"])
def test_torchao_agrees_with_the_from_scratch_path(mode):
    torch.manual_seed(0)
    linear = nn.Linear(80, 48)
    with torch.no_grad():
        linear.weight.copy_(weights_with_varied_rows())
    ours = Int8Linear.from_linear(linear, mode)
    theirs = torchao_quantize(nn.Sequential(copy.deepcopy(linear)), mode)[0]
    assert type(theirs.weight) is not nn.Parameter  # a quantized tensor subclass replaced the float weight
    # Both round each weight to a grid of step at most s = max|row| / 127 (torchao divides by 127.5 and also
    # uses -128), so both dequantized weights lie within s/2 of the float weight, and within s of each other.
    their_deq = theirs.weight.dequantize().double()
    step = ours.scale.double()[:, None]
    assert torch.all((their_deq - linear.weight.double()).abs() <= step / 2 * (1 + 1e-6))
    assert torch.all((their_deq - ours.weight.double()).abs() <= step * (1 + 1e-6))
    x = torch.randn(7, 80)
    with torch.no_grad():
        diff = (ours(x).double() - theirs(x).double()).abs()
    assert torch.all(diff <= 2 * linear_error_bound(x, linear.weight.detach(), ours.scale, mode))


@needs_torchao
def test_torchao_gpt_matches_ours_and_unties_the_head():
    model = model_for()
    ours = quantize_linears(copy.deepcopy(model))
    theirs = torchao_quantize(copy.deepcopy(model))
    assert theirs.lm_head.weight is not theirs.tok_emb.weight  # quantize_ replaced the shared parameter
    idx = torch.randint(0, TINY.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, a, b = model(idx).double(), ours(idx).double(), theirs(idx).double()
    assert ((a - b).norm() / ref.norm()).item() < 0.05
    n_linear = sum(isinstance(m, Int8Linear) for m in ours.modules())  # torchao adds metadata per weight
    assert saved_bytes(theirs) == pytest.approx(saved_bytes(ours), abs=1024 * n_linear)


@needs_torchao
@pytest.mark.parametrize("code", [
    "from helpers.inference.quantization import import_torchao; import_torchao()",
    "import helpers, torchao",  # as transformers imports it when it saves or loads a model
])
def test_torchao_imports_without_the_expected_log_lines(python_process, code):
    done = python_process("-c", code + "; print('imported')", check=True)
    assert done.stdout.strip() == "imported"
    if torch.version.cuda is None:
        assert "Failed to load" not in done.stderr and "register_constant" not in done.stderr
    assert import_torchao().quantization.quantize_ is not None
