"""Activation checkpointing: the same gradients as keeping every activation, less memory kept, and the
selective policy recomputing no matmul."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import GPT, GPTConfig
from helpers.measure.memory_plan import LiveTensorBytes
from helpers.training.step import token_loss_sum

CONFIG = GPTConfig(vocab_size=61, context_length=32, d_model=32, n_heads=4, n_layers=3, dropout=0.1)
MODES = (None, "block", "selective")


def gradients(mode, attn="sdpa", dtype=torch.float64, config=CONFIG):
    torch.manual_seed(0)
    model = GPT(config, attn_implementation=attn).to(dtype).set_activation_checkpointing(mode).train()
    x, y = torch.randint(61, (2, 32)), torch.randint(61, (2, 32))
    torch.manual_seed(1)  # the same dropout masks in every run
    loss = token_loss_sum(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["block", "selective"])
def test_gradients_equal_those_without_checkpointing_with_dropout(mode, attn):
    loss, reference = gradients(None, attn)
    loss_c, grads = gradients(mode, attn)
    assert loss_c == loss
    for name, g in reference.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=1e-14, msg=name)


class CountMatmuls(TorchDispatchMode):
    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.MATMULS
        return func(*args, **(kwargs or {}))


def matmuls(mode):
    """Matmuls run by the forward and by the backward of a training step."""
    torch.manual_seed(0)
    model = GPT(CONFIG).double().set_activation_checkpointing(mode).train()
    x, y = torch.randint(61, (2, 32)), torch.randint(61, (2, 32))
    with CountMatmuls() as forward:
        loss = token_loss_sum(model(x), y)
    with CountMatmuls() as backward:
        loss.backward()
    return forward.count, backward.count


def test_block_recomputes_every_matmul_of_the_blocks_and_selective_none():
    (forward, plain), (_, block), (_, selective) = (matmuls(m) for m in MODES)
    blocks_forward = forward - 1  # all but the LM head's
    assert blocks_forward >= 4 * CONFIG.n_layers  # qkv, out_proj, fc, proj (and attention's own, in float64)
    assert block == plain + blocks_forward  # the forward of every block again
    assert selective == plain


def activation_peak(mode, batch=4, ctx=256):
    """Peak tensor bytes of a forward and backward of gpt-cpu's shape, above its weights (on meta: no data)."""
    config = GPTConfig(vocab_size=512, context_length=ctx, d_model=384, n_heads=6, n_layers=6, dropout=0.0)
    with torch.device("meta"):
        model = GPT(config).set_activation_checkpointing(mode).train()
    x = torch.randint(512, (batch, ctx), device="meta")
    with LiveTensorBytes() as mem:
        token_loss_sum(model(x), x).backward()
    return mem.peak


def test_checkpointing_keeps_less_and_block_keeps_least():
    plain, block, selective = (activation_peak(m) for m in MODES)
    assert plain > selective > block
    assert block < plain / 2


def test_checkpointing_is_off_in_eval_and_unknown_modes_are_refused():
    model = GPT(CONFIG).set_activation_checkpointing("block").eval()
    x = torch.randint(61, (1, 8))
    with CountMatmuls() as counter:
        with torch.no_grad():
            model(x)
    assert counter.count == 4 * CONFIG.n_layers + 1  # a plain forward: blocks and head, once
    with pytest.raises(ValueError, match="unknown activation checkpointing 'all'"):
        model.set_activation_checkpointing("all")
