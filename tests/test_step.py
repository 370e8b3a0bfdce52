"""The one loss and training step every loop uses, against PyTorch's own functions and float64 references."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.training.step import IGNORE_INDEX, TrainingStep, head_loss, lm_loss, token_loss_sum

TINY = GPTConfig(vocab_size=37, context_length=12, d_model=16, n_heads=2, n_layers=1, dropout=0.0)


def batch(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(TINY.vocab_size, (n, TINY.context_length), generator=g) for _ in range(2))
    y[0, 5:] = IGNORE_INDEX
    return x, y


def test_lm_loss_is_cross_entropy_over_the_target_tokens():
    logits = torch.randn(3, 12, 37, dtype=torch.float64)
    _, y = batch()
    expected = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(lm_loss(logits, y), expected)
    padded = torch.cat([logits, torch.full((3, 12, 11), 50.0, dtype=torch.float64)], dim=-1)  # padded head rows
    torch.testing.assert_close(token_loss_sum(padded, y, vocab_size=37), expected * (y != IGNORE_INDEX).sum())


def test_low_precision_logits_are_lost_in_fp32_at_least():
    logits = torch.randn(2, 12, 37) * 8
    _, y = batch(n=2)
    exact = token_loss_sum(logits.double(), y)
    assert token_loss_sum(logits.bfloat16(), y).dtype == torch.float32
    assert torch.allclose(token_loss_sum(logits.bfloat16(), y).double(), exact, rtol=0.02)
    assert token_loss_sum(logits.double(), y).dtype == torch.float64  # float64 stays float64


@pytest.mark.parametrize("grad_clip", [None, 0.05])
def test_the_step_clips_the_global_norm_and_reports_it(grad_clip):
    torch.manual_seed(0)
    model, reference = GPT(TINY).double(), GPT(TINY).double()
    reference.load_state_dict(model.state_dict())
    x, y = batch()
    step = TrainingStep(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_clip=grad_clip,
                        measure_grad_norm=True)
    result = step([(x, y)])
    lm_loss(reference(x), y).backward()
    norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    assert result.grad_norm == pytest.approx(norm, rel=1e-10)
    scale = 1.0 if grad_clip is None else min(1.0, grad_clip / (norm + 1e-6))
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * scale * p.grad
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())


def test_fp16_steps_through_a_grad_scaler_and_skip_overflowing_gradients():
    torch.manual_seed(0)
    model = GPT(TINY)
    step = TrainingStep(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast=torch.float16)
    assert step.scaler.is_enabled()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hook = model.lm_head.register_forward_hook(lambda m, args, out: out * float("inf"))  # overflow
    step([batch()])
    hook.remove()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the step was skipped
    assert step.scaler.get_scale() < 2.0**16  # and the scale backed off


def test_a_failed_step_leaves_no_gradients():
    torch.manual_seed(0)
    model = GPT(TINY)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()))
    x, y = batch()

    class FailsOnSecondCall(nn.Module):  # the first micro-batch's backward has filled the gradients by then
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                raise MemoryError("out of memory (on purpose)")
            return x

    model.blocks[0].mlp.proj = nn.Sequential(model.blocks[0].mlp.proj, FailsOnSecondCall())
    with pytest.raises(MemoryError):
        step([(x, y), (x, y)])
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="no target tokens"):
        TrainingStep(GPT(TINY), torch.optim.SGD(GPT(TINY).parameters(), lr=0.1))([(x, torch.full_like(y, -100))])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.compile
@pytest.mark.parametrize("n_kv_heads", [None, 1])
@pytest.mark.parametrize("loss_chunk", [None, 8])
def test_the_compiled_loss_is_one_graph(attn, n_kv_heads, loss_chunk):
    """torch.compile fuses only within a graph: a break in every layer (a warnings filter in the attention once made
    one) left the compiled step slower than transformers'. The chunked head is one graph where torch traces it."""
    from helpers.model.lm_head import CHUNKED_HEAD_TRACEABLE

    if loss_chunk is not None and not CHUNKED_HEAD_TRACEABLE:
        pytest.skip("before torch 2.13 the chunked head runs eagerly under torch.compile, by design a graph break")
    model = GPT(GPTConfig(vocab_size=37, context_length=12, d_model=16, n_heads=2, n_layers=2, dropout=0.0,
                          n_kv_heads=n_kv_heads), attn_implementation=attn)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters()), autocast=torch.bfloat16,
                        loss=head_loss(loss_chunk))
    torch.compile(step.loss_sum, fullgraph=True, backend="eager")(*batch())  # fullgraph: a graph break raises
