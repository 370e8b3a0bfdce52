"""GPT-2 in the Hugging Face layout loads into helpers.GPT with transformers' logits, and exports back."""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import GPT, GPTConfig
from helpers.model import hub
from helpers.model.hf_gpt2 import (
    WeightsError,
    WeightsUnavailable,
    config_from_hf,
    download_gpt2,
    expected_hf_shapes,
    load_hf_gpt2,
    save_hf_gpt2,
)

transformers = pytest.importorskip("transformers")

TINY_HF = dict(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=4, activation_function="gelu_new",
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


def hf_model(**overrides):
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**TINY_HF, **overrides})).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random GPT2LMHeadModel saved with save_pretrained (safetensors), and its logits on a fixed batch."""
    directory = tmp_path_factory.mktemp("hf")
    model = hf_model()
    model.save_pretrained(directory)
    idx = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx).logits
    return directory, idx, logits


def logits_of(model, idx):
    with torch.no_grad():
        return model(idx)


def rewrite(src, dst, edit):
    """Copy a safetensors file with its tensors changed by `edit(dict) -> dict`."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(edit(dict(load_file(src / "model.safetensors"))), dst, metadata={"format": "pt"})
    return dst


def test_save_pretrained_file_gives_transformers_logits(saved):
    directory, idx, expected = saved
    model = load_hf_gpt2(directory)
    assert model.config == GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=2, dropout=0.0)
    assert model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(logits_of(model, idx), expected, rtol=1e-5, atol=1e-5)


def openai_community_layout(tensors):
    """The layout of openai-community/gpt2's model.safetensors: no prefix, with the attention-mask buffers."""
    out = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    for i in range(TINY_HF["n_layer"]):
        out[f"h.{i}.attn.bias"] = torch.ones(32, 32).tril().view(1, 1, 32, 32)
        out[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def test_unprefixed_file_with_mask_buffers_and_no_config(saved, tmp_path):
    directory, idx, expected = saved
    file = rewrite(directory, tmp_path / "model.safetensors", openai_community_layout)
    with pytest.raises(WeightsError, match="number of heads is not in the tensor shapes.*pass n_heads"):
        load_hf_gpt2(file)
    model = load_hf_gpt2(file, n_heads=4)
    torch.testing.assert_close(logits_of(model, idx), expected, rtol=1e-5, atol=1e-5)


def test_conv1d_weights_are_transposed(saved):
    directory, _, _ = saved
    model = load_hf_gpt2(directory)
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        c_attn = f.get_tensor("transformer.h.1.attn.c_attn.weight")
        wpe = f.get_tensor("transformer.wpe.weight")
    assert c_attn.shape == (48, 144) and torch.equal(model.blocks[1].attn.qkv.weight, c_attn.T)
    assert torch.equal(model.pos_emb.weight, wpe)


def test_export_loads_into_transformers_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=2, dropout=0.0)).eval()
    save_hf_gpt2(ours, tmp_path)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 97, (2, 32))
    torch.testing.assert_close(theirs(idx).logits.detach(), logits_of(ours, idx), rtol=1e-5, atol=1e-5)
    again = load_hf_gpt2(tmp_path)  # and back: the same tensors
    assert all(torch.equal(again.state_dict()[k], t) for k, t in ours.state_dict().items())


def test_an_export_interrupted_between_weights_and_config_is_refused(tmp_path, monkeypatch):
    """New weights beside the previous export's config.json (another head count): the same tensor shapes, so only the
    config tells them apart, and running them with the old config would give wrong logits without an error."""
    config = GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=2, dropout=0.0)
    save_hf_gpt2(GPT(config), tmp_path)
    real_dumps = json.dumps

    def crash_on_config_json(obj, *args, **kwargs):
        if kwargs.get("indent"):  # the config.json write, after the weights are in place
            raise KeyboardInterrupt
        return real_dumps(obj, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", crash_on_config_json)
    with pytest.raises(KeyboardInterrupt):
        save_hf_gpt2(GPT(dataclasses.replace(config, n_heads=2)), tmp_path)
    monkeypatch.undo()
    assert json.loads((tmp_path / "config.json").read_text())["n_head"] == 4  # the old one
    with pytest.raises(WeightsError, match="not the config these weights were exported with \\(n_head differ\\)"):
        load_hf_gpt2(tmp_path)
    extra = json.loads((tmp_path / "config.json").read_text()) | {"n_head": 2, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(extra))  # keys we did not write may be added
    assert load_hf_gpt2(tmp_path).config.n_heads == 2


def test_untied_model_round_trips(tmp_path):
    theirs = hf_model(tie_word_embeddings=False)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_hf_gpt2(tmp_path / "hf")
    assert not ours.config.tie_weights and ours.lm_head.weight is not ours.tok_emb.weight
    idx = torch.randint(0, 97, (1, 16))
    torch.testing.assert_close(logits_of(ours, idx), theirs(idx).logits.detach(), rtol=1e-5, atol=1e-5)
    save_hf_gpt2(ours, tmp_path / "ours")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ours").eval()
    torch.testing.assert_close(back(idx).logits, theirs(idx).logits, rtol=1e-5, atol=1e-5)


def test_dtype_and_device_on_load(saved):
    directory, _, _ = saved
    model = load_hf_gpt2(directory, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(p.is_contiguous() for p in model.parameters())


@pytest.mark.parametrize("preset", ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_gpt2_sizes_are_recognised_from_shapes_alone(preset):
    config = GPTConfig.from_preset(preset)
    shapes = expected_hf_shapes(config)
    assert shapes["h.0.attn.c_attn.weight"] == (config.d_model, 3 * config.d_model)
    assert config_from_hf(shapes) == config


def test_preset_mismatch_names_the_sizes_and_the_fix(saved):
    directory, _, _ = saved
    with pytest.raises(WeightsError, match=r"holds a model with vocab_size 97, .*d_model 48.*but 'gpt2-small' has "
                                           r"vocab_size 50257.*d_model 768.*pass preset=None"):
        load_hf_gpt2(directory, preset="gpt2-small")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: {**t, "transformer.h.1.mlp.c_fc.weight": torch.zeros(48, 100)},
     r"tensor 'h.1.mlp.c_fc.weight' \(a Conv1D weight, stored \(in, out\)\) has shape \(48, 100\), "
     r"expected \(48, 192\)"),
    (lambda t: {k: v for k, v in t.items() if k != "transformer.h.0.ln_2.bias"},
     r"lacks 1 tensor\(s\) of this GPT-2, e.g. 'h.0.ln_2.bias'.*re-download"),
    (lambda t: {**t, "transformer.h.0.attn.q_norm.weight": torch.ones(48)},
     r"has 1 tensor\(s\) GPT-2 does not, e.g. 'h.0.attn.q_norm.weight'"),
    (lambda t: {k: v for k, v in t.items() if not k.startswith("transformer.h.")},
     r"no transformer blocks"),
])
def test_bad_tensors_are_named_with_what_to_do(saved, tmp_path, edit, message):
    directory, _, _ = saved
    rewrite(directory, tmp_path / "model.safetensors", edit)
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(WeightsError, match=message):
        load_hf_gpt2(tmp_path)


@pytest.mark.parametrize(("change", "message"), [
    ({"activation_function": "relu"}, "activation_function='relu'.*use transformers"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"n_inner": 100}, "n_inner=100"),
])
def test_unsupported_architecture_in_config_json(saved, tmp_path, change, message):
    directory, _, _ = saved
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**json.loads((directory / "config.json").read_text()),
                                                      **change}))
    with pytest.raises(WeightsError, match=message):
        load_hf_gpt2(tmp_path)


def test_missing_file_and_non_gpt2_config(tmp_path):
    with pytest.raises(WeightsError, match="no safetensors file at .*give the model.safetensors file or its folder"):
        load_hf_gpt2(tmp_path)
    with pytest.raises(WeightsError, match="GPT-2's layout holds the feed-forward types gelu, not ffn_type='swiglu'"):
        save_hf_gpt2(GPT(GPTConfig.from_preset("gpt-smoke", ffn_type="swiglu")), tmp_path)
    with pytest.raises(WeightsError, match="has biases.*bias=True"):
        save_hf_gpt2(GPT(GPTConfig.from_preset("gpt-smoke", bias=False)), tmp_path)


def test_download_fails_fast_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    real = huggingface_hub.hf_hub_download

    def spy(*args, **kwargs):
        calls.append(kwargs["local_files_only"])
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read when huggingface_hub was imported
    # port 9 on this machine: refused at once, so the probe answers "unreachable" without waiting
    with pytest.raises(WeightsUnavailable, match="is not cached and http://127.0.0.1:9 is unreachable"):
        download_gpt2(cache_dir=tmp_path, endpoint="http://127.0.0.1:9", timeout=2)
    assert calls == [True]  # only the cache was asked: the client's retries (half a minute) never ran


def test_download_respects_hf_hub_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "hub_reachable", lambda *a: pytest.fail("probed the network while offline"))
    with pytest.raises(WeightsUnavailable, match="HF_HUB_OFFLINE is set"):
        download_gpt2(cache_dir=tmp_path)
