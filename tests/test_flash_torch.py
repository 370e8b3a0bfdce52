"""FlashAttention in pure PyTorch against float64 textbook attention, SDPA, and a recorder of every tensor it makes."""

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.model.flash_torch import FlashAttentionTorch, flash_attention_torch


def reference_attention(q, k, v, causal):
    """softmax(Q K^T * scale + mask) V in float64; causal keeps keys j <= i, as SDPA's is_causal does."""
    q, k, v = (t.double() for t in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if causal:
        future = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def random_qkv(batch, heads, seq_q, seq_k, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, heads, seq_k, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, heads, seq_k, head_dim, generator=gen).to(dtype)
    grad_o = torch.randn(batch, heads, seq_q, head_dim, generator=gen).to(dtype)
    return q, k, v, grad_o


def output_and_grads(attention, q, k, v, grad_o):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), grad_o))


def assert_matches_reference(q, k, v, grad_o, causal, block_size_q, block_size_k, atol, rtol):
    ours = output_and_grads(
        lambda q, k, v: flash_attention_torch(q, k, v, causal, block_size_q, block_size_k), q, k, v, grad_o
    )
    # The reference sees the very same (possibly rounded) inputs, upcast to float64.
    q64, k64, v64, grad_o64 = (t.double() for t in (q, k, v, grad_o))
    expected = output_and_grads(lambda q, k, v: reference_attention(q, k, v, causal), q64, k64, v64, grad_o64)
    for name, got, want in zip(("o", "dq", "dk", "dv"), ours, expected, strict=True):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


SHAPES = [  # batch, heads, seq_q, seq_k, head_dim, block_size_q, block_size_k
    pytest.param(1, 1, 1, 1, 8, 64, 64, id="seq1"),
    pytest.param(1, 2, 5, 5, 16, 64, 64, id="one-block-larger-than-seq"),
    pytest.param(2, 3, 67, 67, 16, 32, 16, id="seq67-bq32-bk16"),
    pytest.param(1, 2, 130, 130, 64, 32, 16, id="batch1-seq130-hd64"),
    pytest.param(2, 2, 130, 130, 8, 16, 32, id="seq130-bq16-bk32-hd8"),
    pytest.param(2, 1, 64, 64, 16, 16, 16, id="block-multiple"),
    pytest.param(2, 2, 37, 70, 16, 16, 32, id="seq_q<seq_k"),
    pytest.param(2, 2, 70, 37, 16, 32, 16, id="seq_q>seq_k"),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("batch,heads,seq_q,seq_k,head_dim,block_size_q,block_size_k", SHAPES)
def test_float32_matches_float64_reference(batch, heads, seq_q, seq_k, head_dim, block_size_q, block_size_k, causal):
    q, k, v, grad_o = random_qkv(batch, heads, seq_q, seq_k, head_dim, torch.float32)
    assert_matches_reference(q, k, v, grad_o, causal, block_size_q, block_size_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_float64_matches_reference_to_rounding(causal):
    q, k, v, grad_o = random_qkv(2, 2, 67, 67, 16, torch.float64)
    assert_matches_reference(q, k, v, grad_o, causal, 32, 16, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_half_precision_matches_reference_of_rounded_inputs(dtype, causal):
    """Tiles accumulate in float32, so what is left is rounding O and the grads to 8 (bf16) or 11 (fp16) bits."""
    q, k, v, grad_o = random_qkv(2, 2, 130, 130, 64, dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    assert_matches_reference(q, k, v, grad_o, causal, 32, 16, atol=tol, rtol=tol)


@pytest.mark.parametrize("seq_q,seq_k", [(67, 67), (40, 67), (67, 40)])
def test_agrees_with_sdpa_is_causal(seq_q, seq_k):
    q, k, v, grad_o = random_qkv(2, 3, seq_q, seq_k, 32, torch.float32)
    ours = output_and_grads(lambda q, k, v: flash_attention_torch(q, k, v, True, 32, 16), q, k, v, grad_o)
    theirs = output_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, grad_o)
    for got, want in zip(ours, theirs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_default_is_causal_and_apply_is_the_same_function():
    q, k, v, _ = random_qkv(1, 2, 50, 50, 16, torch.float32)
    o = flash_attention_torch(q, k, v)
    torch.testing.assert_close(o, FlashAttentionTorch.apply(q, k, v, True, 64, 64), atol=0, rtol=0)
    torch.testing.assert_close(o.double(), reference_attention(q, k, v, causal=True), atol=1e-5, rtol=1e-5)


def test_gradients_only_for_inputs_that_need_them():
    q, k, v, grad_o = random_qkv(2, 2, 45, 45, 16, torch.float32)
    v.requires_grad_()
    (flash_attention_torch(q, k, v, True, 16, 16) * grad_o).sum().backward()
    assert q.grad is None and k.grad is None
    v64 = v.detach().double().requires_grad_()
    (reference_attention(q, k, v64, causal=True) * grad_o.double()).sum().backward()
    torch.testing.assert_close(v.grad.double(), v64.grad, atol=1e-5, rtol=1e-5)


def test_non_contiguous_inputs():
    """Heads split from (batch, seq, heads, head_dim) by a transpose, as in CausalSelfAttention."""
    qkv_do = random_qkv(2, 3, 33, 33, 8, torch.float32)
    q, k, v, grad_o = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in qkv_do)
    assert not q.is_contiguous()
    assert_matches_reference(q, k, v, grad_o, True, 16, 8, atol=1e-5, rtol=1e-5)


class TensorRecorder(TorchDispatchMode):
    """Records (op, shape, dtype) of every tensor any aten op returns, in forward and in backward alike."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((func.__name__, tuple(t.shape), t.dtype))
        return out


def record_forward_and_backward(attention, seq, head_dim=16):
    q, k, v, grad_o = random_qkv(1, 2, seq, seq, head_dim, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with TensorRecorder() as forward:
        o = attention(q, k, v)
    with TensorRecorder() as backward:
        o.backward(grad_o)
    return forward.made, backward.made


def square_at_least(made, seq):
    return [(op, shape) for op, shape, _ in made if len(shape) >= 2 and min(shape[-2:]) >= seq]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_never_materialises_a_seq_by_seq_tensor(causal):
    seq = 256
    # The recorder can see one: textbook attention makes seq x seq scores forward and their gradient backward.
    eager_fwd, eager_bwd = record_forward_and_backward(lambda q, k, v: reference_attention(q, k, v, causal), seq)
    assert square_at_least(eager_fwd, seq) and square_at_least(eager_bwd, seq)
    flash_fwd, flash_bwd = record_forward_and_backward(
        lambda q, k, v: flash_attention_torch(q, k, v, causal, 32, 32), seq
    )
    assert flash_fwd and flash_bwd
    assert square_at_least(flash_fwd, seq) == [] and square_at_least(flash_bwd, seq) == []


@pytest.mark.parametrize("causal,tiles,masked", [(True, 36, 8), (False, 64, 0)], ids=["causal", "full"])
def test_causal_skips_future_tiles_and_masks_only_the_diagonal(causal, tiles, masked):
    """seq 256 in blocks of 32 is an 8 x 8 grid of tiles: causal visits the 36 on or below the diagonal."""
    made = record_forward_and_backward(lambda q, k, v: flash_attention_torch(q, k, v, causal, 32, 32), 256)
    for pass_made in made:
        counts = Counter((op, dtype) for op, shape, dtype in pass_made if shape[-2:] == (32, 32))
        assert counts["exp.default", torch.float32] == tiles  # one P tile per visited (query block, key block)
        assert sum(n for (_, dtype), n in counts.items() if dtype == torch.bool) == masked


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda q, k, v: (q[0], k, v), "q must be a 4-d tensor"),
        (lambda q, k, v: (q, k.double(), v), "share one floating-point dtype"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), "floating-point"),
        (lambda q, k, v: (q, k[:, :1], v[:, :1]), "share batch, heads and head_dim"),
        (lambda q, k, v: (q, k[..., :4], v[..., :4]), "share batch, heads and head_dim"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "k and v must have the same shape"),
        (lambda q, k, v: (q[:, :, :0], k, v), "seq and head_dim must be at least 1"),
        (lambda q, k, v: (q, k, v.to("meta")), "must be on one device"),
    ],
)
def test_bad_inputs_raise_one_line_value_errors(change, message):
    q, k, v, _ = random_qkv(2, 2, 8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match=message) as err:
        flash_attention_torch(*change(q, k, v))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("blocks", [(0, 16), (16, -1), (16.0, 16), (True, 16)])
def test_bad_block_sizes_raise(blocks):
    q, k, v, _ = random_qkv(1, 1, 8, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="must be a positive int"):
        flash_attention_torch(q, k, v, True, *blocks)
