"""LoRA against references: a layer against W + (alpha / r)·B·A written out in float64, the model unchanged at step
0, merged logits equal to unmerged ones in float64 whichever attention kernel runs, only the adapters trained,
adapters saved and loaded on their own, and LoRA over int8 base weights."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from helpers.inference.kv_cache import generate_with_cache
from helpers.inference.quantization import Int8Linear, quantize_linears
from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.training.lora import (
    EmbeddingAdapter,
    LoRALinear,
    adapter_state_dict,
    add_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    save_adapter,
    trainable_parameters,
    vocabulary_adapters,
)
from helpers.training.step import TrainingStep

CONFIG = GPTConfig(vocab_size=61, context_length=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0)


def model64(config: GPTConfig = CONFIG, seed: int = 0, attn_implementation: str = "sdpa") -> GPT:
    torch.manual_seed(seed)
    return GPT(config, attn_implementation=attn_implementation).double().eval()


def randomise_adapters(model: GPT, seed: int = 1) -> None:
    """B starts at zero; give it values so the update is not zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        adapters = [*lora_layers(model).values(), *(m for m in vocabulary_adapters(model).values()
                                                    if isinstance(m, EmbeddingAdapter) and m.rank)]
        for layer in adapters:
            layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=generator, dtype=layer.lora_b.dtype) * 0.1)


def tokens(batch: int = 2, seq: int = 12, seed: int = 2) -> torch.Tensor:
    return torch.randint(CONFIG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def train(model: GPT, x: torch.Tensor, y: torch.Tensor, steps: int = 20, lr: float = 1e-2) -> list[float]:
    """The course's training step on one batch, AdamW over what is left trainable; the loss of each step."""
    step = TrainingStep(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr))
    return [step([(x, y)]).loss for _ in range(steps)]


def test_a_lora_layer_is_the_weight_plus_the_scaled_low_rank_update():
    base = torch.nn.Linear(24, 40, dtype=torch.float64)
    layer = LoRALinear(base, rank=4, alpha=8.0)
    with torch.no_grad():
        layer.lora_b.normal_()
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    reference = F.linear(x, base.weight + (8.0 / 4) * layer.lora_b @ layer.lora_a, base.bias)
    torch.testing.assert_close(layer(x), reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(layer.weight, base.weight + 2.0 * layer.lora_b @ layer.lora_a, rtol=0, atol=1e-14)
    assert layer.lora_a.abs().sum() > 0 and not base.weight.requires_grad


def test_the_model_is_unchanged_at_step_zero_and_only_the_adapters_train():
    model = model64()
    x, y = tokens(), tokens(seed=3)
    before = model(x)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters()}
    add_lora(model, rank=4, alpha=8.0)
    assert torch.equal(model(x), before)
    d, r = CONFIG.d_model, 4
    per_block = r * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))  # qkv, out_proj, fc, proj: r·(in + out)
    assert trainable_parameters(model) == CONFIG.n_layers * per_block
    losses = train(model.train(), x, y)
    assert losses[-1] < losses[0] - 0.5, losses
    base_names = {n.replace(".base.", "."): p for n, p in model.named_parameters() if "lora_" not in n}
    assert base_names.keys() == frozen.keys()
    assert all(torch.equal(base_names[n], frozen[n]) for n in frozen)


@pytest.mark.parametrize("implementation", ["sdpa", "stacked", "einsum", "wrapper"])
def test_merged_logits_equal_the_adapted_ones_in_float64(implementation):
    model = add_lora(model64(attn_implementation=implementation), rank=4, alpha=8.0)
    randomise_adapters(model)
    x = tokens()
    adapted = model(x)
    assert not torch.allclose(adapted, model64(attn_implementation=implementation)(x))  # the update changes logits
    merged = merge_lora(model)
    assert not lora_layers(merged)
    plain = model64(attn_implementation=implementation)
    plain.load_state_dict(merged.state_dict(), strict=True)  # a plain GPT again
    torch.testing.assert_close(plain(x), adapted, rtol=0, atol=1e-10)


def test_cached_generation_runs_the_adapted_model():
    model = add_lora(model64(), rank=2, alpha=4.0)
    randomise_adapters(model)
    prompt = tokens(batch=1, seq=4)
    adapted = generate_with_cache(model, prompt, 8)
    assert torch.equal(adapted, generate_with_cache(merge_lora(model), prompt, 8))


def test_an_adapter_saves_and_loads_on_its_own(tmp_path):
    model = add_lora(model64(), rank=4, alpha=8.0, targets=("attn.qkv",))
    randomise_adapters(model)
    x = tokens()
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter_state_dict(model).values())
    assert adapter_bytes < path.stat().st_size < adapter_bytes + 4096  # the adapters and a header, not the model
    loaded = load_adapter(model64(), path)
    assert sorted(lora_layers(loaded)) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv"]
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_an_adapter_that_does_not_fit_is_refused_and_the_model_left_as_it_was(tmp_path):
    path = save_adapter(add_lora(model64(), rank=4, alpha=8.0), tmp_path / "adapter.safetensors")
    wider = model64(dataclasses.replace(CONFIG, d_model=48))
    with pytest.raises(ValueError, match="does not fit this model: missing \\[\\], unexpected \\[\\], wrong shape"):
        load_adapter(wider, path)
    assert not lora_layers(wider)
    deeper_adapter = save_adapter(add_lora(model64(dataclasses.replace(CONFIG, n_layers=3))), tmp_path / "deep.st")
    with pytest.raises(ValueError, match="adapts a layer this model lacks, 'blocks.2.attn."):
        load_adapter(model64(), deeper_adapter)
    for again in (add_lora, lambda model: load_adapter(model, path)):
        with pytest.raises(ValueError, match="already has LoRA layers"):
            again(load_adapter(model64(), path))


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
def test_the_new_tokens_rows_train_with_the_adapters_and_nothing_else_of_the_embedding(tmp_path, tie_weights):
    """Tokens a model never saw (chat markers added at the end of its vocabulary) get rows of their own: at step 0
    the model is unchanged, training moves those rows of the embedding and the head (one parameter when tied) and
    no other, and the rows are merged and saved with the adapters."""
    config = dataclasses.replace(CONFIG, tie_weights=tie_weights)
    new = [58, 59, 60]
    model, x = model64(config), tokens()
    y = torch.full_like(x, 60)  # every target is a new token: only its rows can make it likely
    before = model(x)
    add_lora(model, rank=2, alpha=4.0, train_tokens=new)
    assert torch.equal(model(x), before)
    per_table = len(new) * CONFIG.d_model
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert trainable_parameters(model) == adapters + per_table * (1 if tie_weights else 2)
    losses = train(model.train(), x, y, steps=30, lr=3e-2)
    assert losses[-1] < losses[0] - 1.0, losses
    embedding = model.tok_emb.weight.detach()
    frozen = model64(config).tok_emb.weight
    changed = (embedding != frozen).any(-1).nonzero().flatten().tolist()
    assert changed == new  # and no other row
    if tie_weights:
        assert torch.equal(model.lm_head.weight, model.tok_emb.weight)
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    loaded = load_adapter(model64(config), path).eval()
    model.eval()
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    merged = merge_lora(model)
    plain = model64(config)
    plain.load_state_dict(merged.state_dict(), strict=True)
    torch.testing.assert_close(plain(x), loaded(x), rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="train_tokens must be token ids of the model's vocabulary, 0 to 60"):
        add_lora(model64(config), train_tokens=[61])


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
def test_the_vocabulary_matrix_takes_a_lora_update_shared_by_a_tied_head(tmp_path, tie_weights):
    """"tok_emb" (and "lm_head") as targets: the embedding matrix gets W + (alpha / r)·B·A, one update for the
    embedding and a tied head, checked against that matrix written out in float64; it trains, saves, loads and
    merges with the block adapters and the new tokens' rows."""
    config = dataclasses.replace(CONFIG, tie_weights=tie_weights)
    new, x = [59, 60], tokens()
    model = model64(config)
    before = model(x)
    add_lora(model, rank=3, alpha=6.0, targets=("attn.qkv", "tok_emb", "lm_head"), train_tokens=new)
    assert torch.equal(model(x), before)  # B at zero
    vocab, width = CONFIG.vocab_size, CONFIG.d_model
    matrices = 1 if tie_weights else 2
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.") and p.requires_grad)
    assert trainable_parameters(model) == blocks + matrices * (3 * (vocab + width) + len(new) * width)
    randomise_adapters(model)
    with torch.no_grad():
        for adapter in vocabulary_adapters(model).values():
            if isinstance(adapter, EmbeddingAdapter):
                adapter.trained.normal_()
    reference = model64(config)  # the update written out: W + (alpha / r)·B·A, the trained rows in place
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            reference.get_submodule(name).weight.add_(2.0 * layer.lora_b @ layer.lora_a)
        for name in ("tok_emb",) if tie_weights else ("tok_emb", "lm_head"):
            adapter, weight = getattr(model, name), getattr(reference, name).weight
            weight[new] = adapter.trained
            weight.add_(2.0 * adapter.lora_b @ adapter.lora_a)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=1e-10)
    path = save_adapter(model, tmp_path / "adapter.safetensors")
    loaded = load_adapter(model64(config), path)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    merged = merge_lora(loaded)
    assert isinstance(merged.tok_emb, torch.nn.Embedding) and isinstance(merged.lm_head, torch.nn.Linear)
    assert (merged.lm_head.weight is merged.tok_emb.weight) == tie_weights
    torch.testing.assert_close(merged(x), reference(x), rtol=0, atol=1e-10)
    fresh = add_lora(model64(config), rank=3, alpha=6.0, targets=("tok_emb",))
    frozen = fresh.tok_emb.base.weight.clone()
    losses = train(fresh.train(), x, tokens(seed=3), steps=30, lr=3e-2)
    assert losses[-1] < losses[0] - 0.3, losses
    assert torch.equal(fresh.tok_emb.base.weight, frozen) and fresh.tok_emb.lora_b.abs().sum() > 0


def test_bad_arguments_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="no Linear layer of the model is named ...attn.q_proj; its layers end with"
                                         ".* or adapt tok_emb or lm_head"):
        add_lora(model64(), targets=("attn.q_proj",))
    with pytest.raises(ValueError, match="rank must be a positive integer, got 0"):
        add_lora(model64(), rank=0)
    with pytest.raises(ValueError, match="no LoRA layers to save"):
        save_adapter(model64(), "unused.safetensors")


def test_lora_over_int8_weights_starts_equal_trains_and_merges():
    torch.manual_seed(0)
    model = quantize_linears(GPT(CONFIG).eval(), skip=("lm_head",))
    assert isinstance(model.blocks[0].mlp.fc, Int8Linear)
    x, y = tokens(), tokens(seed=3)
    before = model(x)
    add_lora(model, rank=4, alpha=8.0)
    assert torch.equal(model(x), before)
    assert trainable_parameters(model) > 0 and all(
        "lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    losses = train(model, x, y)
    assert losses[-1] < losses[0] - 0.5, losses
    adapted = model(x)
    merged = merge_lora(model)
    assert isinstance(merged.blocks[0].mlp.fc, torch.nn.Linear)
    torch.testing.assert_close(merged(x), adapted, rtol=1e-5, atol=1e-5)


def test_the_int8_layers_input_gradient_is_the_dequantized_weights():
    layer = Int8Linear.from_linear(torch.nn.Linear(16, 24, dtype=torch.float64))
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 24, dtype=torch.float64)
    layer(x).backward(grad)
    reference = x.detach().clone().requires_grad_()
    F.linear(reference, layer.weight, layer.bias).backward(grad)
    torch.testing.assert_close(x.grad, reference.grad, rtol=0, atol=1e-12)
