"""The virtual accelerator (helpers.system.virtual_device): placement mistakes raise as on CUDA; correct code
computes what it computes on the CPU."""

import pytest
import torch

import helpers
from helpers.inference.kv_cache import KVCache, generate_with_cache
from helpers.system.virtual_device import ACCELERATOR, PlacementError, on_accelerator, virtual_accelerator

CONFIG = helpers.GPTConfig(vocab_size=64, context_length=32, d_model=32, n_heads=2, n_layers=2, dropout=0.0)


def test_a_host_tensor_meeting_an_accelerator_tensor_raises():
    with virtual_accelerator() as device:
        on_device = torch.ones(3, device=device)
        with pytest.raises(PlacementError, match="Expected all tensors to be on the same device"):
            on_device + torch.ones(3)
        assert on_accelerator(on_device * torch.tensor(2.0))  # a 0-d host tensor is a scalar, as on CUDA
        assert on_accelerator(on_device + torch.ones(3).to(device))
        back = (on_device * 2).cpu()
        assert not on_accelerator(back) and torch.equal(back, torch.full((3,), 2.0))


def test_a_generator_must_be_made_for_the_device_it_draws_for():
    with virtual_accelerator() as device:
        probs = torch.tensor([0.2, 0.8], device=device)
        with pytest.raises(PlacementError, match="generator"):
            torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))
        drawn = torch.multinomial(probs, 1, generator=torch.Generator(device).manual_seed(0)).cpu()
        expected = torch.multinomial(torch.tensor([0.2, 0.8]), 1, generator=torch.Generator().manual_seed(0))
    assert drawn.tolist() == expected.tolist()  # the same draws as the CPU's generator with that seed
    assert type(torch.Generator()) is torch._C.Generator  # restored on exit


def test_a_model_on_the_accelerator_computes_what_it_computes_on_the_cpu():
    torch.manual_seed(0)
    model = helpers.GPT(CONFIG).eval()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 8))
    expected_logits, expected_tokens = model(idx), generate_with_cache(model, idx, 6)
    with virtual_accelerator() as device:
        moved = helpers.GPT(CONFIG).eval()
        moved.load_state_dict(model.state_dict())
        moved.to(device)
        assert all(on_accelerator(p) for p in moved.parameters())
        logits = moved(idx.to(device))
        tokens = generate_with_cache(moved, idx.to(device), 6)  # inference mode, a cache made on idx's device
        assert on_accelerator(logits) and on_accelerator(tokens)
        assert torch.allclose(logits.cpu(), expected_logits) and torch.equal(tokens.cpu(), expected_tokens)
        with pytest.raises(RuntimeError, match="device"):  # the mistake ch06/06 made: a cache left on the CPU
            moved(idx.to(device), cache=KVCache(CONFIG, 2, 16))


def test_training_on_the_accelerator_matches_the_cpu():
    def one_step(device):
        torch.manual_seed(0)
        model = helpers.GPT(CONFIG).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx = torch.randint(0, CONFIG.vocab_size, (2, 9)).to(device)
        loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        return loss.item(), [p.detach().cpu() for p in model.parameters()]

    loss, weights = one_step("cpu")
    with virtual_accelerator() as device:
        loss_there, weights_there = one_step(device)
    assert loss_there == pytest.approx(loss, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(weights, weights_there, strict=True))


def test_numpy_of_an_accelerator_tensor_says_to_copy_it_first():
    with virtual_accelerator() as device, pytest.raises(PlacementError, match=r"\.cpu\(\)"):
        torch.ones(2, device=device).numpy()
    assert ACCELERATOR.type == "cpu"  # the code paths stay the CPU's


def test_moving_a_tensor_copies_it_in_inference_mode_too():
    """In inference mode `.to(device)` reaches the mode as aten::to, which on the CPU returns its input."""
    with virtual_accelerator() as device, torch.inference_mode():
        host = torch.zeros(3)
        moved = host.to(device)
        moved.add_(1)
        assert torch.equal(host, torch.zeros(3)) and torch.equal(moved.cpu(), torch.ones(3))
