"""The chunked LM head and cross-entropy against the plain head: the same loss and gradients, less memory."""

import pytest
import torch
import torch.nn.functional as F

from helpers import GPT, GPTConfig
from helpers.measure.memory_plan import LiveTensorBytes
from helpers.model.lm_head import IGNORE_INDEX, chunk_tokens_for, chunked_cross_entropy
from helpers.training.step import ChunkedLoss, TrainingStep, head_loss, token_loss_sum

TINY = GPTConfig(vocab_size=97, context_length=32, d_model=32, n_heads=4, n_layers=2, dropout=0.0)


def plain_and_chunked(n_tokens, d, rows, vocab_size, chunk, dtype=torch.float64, ignored=()):
    torch.manual_seed(0)
    hidden = torch.randn(3, n_tokens, d, dtype=dtype)
    weight = torch.randn(rows, d, dtype=dtype) * 0.3
    targets = torch.randint(vocab_size, (3, n_tokens))
    for b, t in ignored:
        targets[b, t] = IGNORE_INDEX
    out = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if chunked:
            loss = chunked_cross_entropy(h, w, targets, chunk, vocab_size)
        else:
            logits = (h @ w.T)[..., :vocab_size]
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        (2.5 * loss).backward()  # a scale on the way back, as a loss divided by the step's tokens has
        out.append((loss.detach(), h.grad, w.grad))
    return out


@pytest.mark.parametrize("chunk", [1, 5, 16, 48, 1000])
@pytest.mark.parametrize("rows, vocab_size", [(61, 61), (64, 61)])  # 64 rows: a padded head
def test_loss_and_gradients_equal_the_plain_head_in_float64(chunk, rows, vocab_size):
    (loss, gh, gw), (loss_c, gh_c, gw_c) = plain_and_chunked(16, 8, rows, vocab_size, chunk,
                                                             ignored=[(0, 3), (2, 15), (1, 0)])
    torch.testing.assert_close(loss_c, loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(gh_c, gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw_c, gw, rtol=1e-10, atol=1e-12)
    if rows > vocab_size:  # the padding rows are not classes: no gradient
        assert gw_c[vocab_size:].abs().max() == 0


def test_ignored_tokens_carry_no_loss_and_no_gradient():
    (_, gh, _), (loss_c, gh_c, _) = plain_and_chunked(4, 8, 31, 31, 3, ignored=[(b, t) for b in range(3)
                                                                                 for t in range(4)])
    assert loss_c == 0 and gh_c.abs().max() == 0 and gh.abs().max() == 0


def test_under_bf16_autocast_it_matches_the_plain_head_within_bf16_rounding():
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 40, 32), torch.randn(97, 32) * 0.2
    targets = torch.randint(97, (2, 40))
    results = []
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = chunked_cross_entropy(h, w, targets, 16) if chunked else token_loss_sum(h @ w.T, targets)
        loss.backward()
        assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
        results.append((loss.detach(), h.grad, w.grad))
    (loss, gh, gw), (loss_c, gh_c, gw_c) = results
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)  # the same bf16 logits, the loss in fp32
    for ours, plain in ((gh_c, gh), (gw_c, gw)):  # bf16 matmuls of other shapes: a few bf16 steps apart
        assert (ours - plain).norm() <= 1e-2 * plain.norm()


def test_under_fp16_autocast_and_a_loss_scale_small_probabilities_keep_their_gradient():
    """fp16 + GradScaler: the backward runs on loss x scale so that small gradients stay above fp16's smallest
    numbers. A confident model's gradient is made of small probabilities (~1.5e-8 here, below fp16's 6e-8): the
    plain head keeps them (its logits' gradient is scaled before it is cast to fp16), and so must the chunked one,
    although it computes its gradient in the forward, before the scale is applied."""
    torch.manual_seed(0)
    vocab, d, n = 512, 32, 24
    targets = torch.randperm(vocab)[:n][None]
    hidden = torch.linalg.qr(torch.randn(d, n)).Q.T[None] * 0.5  # orthogonal hidden states: no token sees another's row
    weight = torch.randn(vocab, d) * 0.01
    weight[targets[0]] = 18.0 * hidden[0] / 0.25  # each token's target logit: 18, the others near 0
    others = torch.ones(vocab, dtype=torch.bool)
    others[targets[0]] = False
    scale = 2.0**16
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logits64 = h64 @ w64.T
    token_loss_sum(logits64, targets).backward()
    probabilities = logits64.detach().softmax(-1)[0][:, others]
    assert probabilities.max() < torch.finfo(torch.float16).smallest_normal / 1000  # flushed to 0 in fp16 unscaled
    errors = {}
    for chunked in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = chunked_cross_entropy(h, w, targets, 8) if chunked else token_loss_sum(h @ w.T, targets)
        (loss * scale).backward()  # what GradScaler.scale(loss).backward() does
        errors["chunked" if chunked else "plain"] = [
            float(((g / scale).double() - ref).norm() / ref.norm())
            for g, ref in ((h.grad, h64.grad), (w.grad[others], w64.grad[others]))]
    for name, (hidden_error, others_error) in errors.items():
        assert others_error < 0.05, errors  # the other classes' weight gradients: p x h, fp16 rounding of them
        # the hidden states' gradient is a difference of nearly equal terms: fp16's rounding of the head shows in it
        assert hidden_error < 0.2, (name, errors)


def test_gpt_loss_sum_equals_the_loss_of_its_logits_with_tied_weights():
    torch.manual_seed(0)
    x, y = torch.randint(97, (2, 32)), torch.randint(97, (2, 32))
    grads = []
    for chunked in (False, True):
        torch.manual_seed(1)
        model = GPT(TINY).double()
        loss = model.loss_sum(x, y, 7) if chunked else token_loss_sum(model(x), y)
        loss.backward()
        grads.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert grads[1][0] == pytest.approx(grads[0][0], rel=1e-12)
    assert "tok_emb.weight" in grads[0][1]  # the tied head's gradient: embedding and head contributions
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_training_step_with_loss_chunk_makes_the_plain_update():
    torch.manual_seed(0)
    batches = [(torch.randint(97, (2, 32)), torch.randint(97, (2, 32))) for _ in range(2)]
    models = []
    for chunk in (None, 9):
        torch.manual_seed(1)
        model = GPT(TINY).double()
        TrainingStep(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss=head_loss(chunk))(batches)
        models.append(model)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def loss_peak_bytes(batch, ctx, vocab, d, chunk):
    """Peak tensor bytes of the head and loss, forward and backward, above their inputs (on meta: no data)."""
    with LiveTensorBytes() as mem:
        hidden = torch.randn(batch, ctx, d, device="meta", requires_grad=True)
        weight = torch.randn(vocab, d, device="meta", requires_grad=True)
        targets = torch.randint(vocab, (batch, ctx), device="meta")
        inputs = mem.current
        if chunk is None:
            loss = token_loss_sum(hidden @ weight.T, targets)
        else:
            loss = chunked_cross_entropy(hidden, weight, targets, chunk)
        loss.backward()
    return mem.peak - inputs


def test_chunked_loss_needs_4x_less_memory_at_gpt2_small_and_context_1024():
    vocab, d = 50257, 768
    chunk = chunk_tokens_for(vocab)
    weight_grad = vocab * d * 4  # both heads end with the weight's gradient
    for batch in (1, 8):
        plain, chunked = (loss_peak_bytes(batch, 1024, vocab, d, c) for c in (None, chunk))
        assert plain - weight_grad >= 2 * batch * 1024 * vocab * 4  # logits and their gradient, at least
        assert chunked - weight_grad <= 4 * chunk * vocab * 4 + 2 * batch * 1024 * d * 4
        assert plain >= 4 * chunked or batch == 1
        assert plain - weight_grad >= 4 * (chunked - weight_grad)


def test_chunk_size_fits_the_logits_budget():
    assert chunk_tokens_for(50257) == 128 and chunk_tokens_for(50304) == 128
    assert chunk_tokens_for(32000) == 256 and chunk_tokens_for(10**9) == 1
    assert chunk_tokens_for(1000, budget_bytes=4000 * 7) == 4


def test_bad_arguments_are_refused():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(10, (4,))
    with pytest.raises(ValueError, match="chunk_tokens must be 1 or more"):
        chunked_cross_entropy(h, w, t, 0)
    with pytest.raises(ValueError, match="one target per token"):
        chunked_cross_entropy(h, w, t[:3], 2)
    with pytest.raises(ValueError, match="outside 1..10"):
        chunked_cross_entropy(h, w, t, 2, vocab_size=11)
    with pytest.raises(ValueError, match="budget"):
        chunk_tokens_for(0)
    for chunk in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="the loss chunk must be a positive number of tokens"):
            ChunkedLoss(chunk)
