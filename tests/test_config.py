import pytest
import torch

from helpers import GPT, PRESETS, GPTConfig

# Parameter counts of Hugging Face's GPT2LMHeadModel (tied LM head) for the four GPT-2 sizes.
GPT2_PARAMETERS = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("name", list(GPT2_PARAMETERS))
def test_gpt2_parameter_counts(name):
    with torch.device("meta"):  # shapes only: no memory, no time
        model = GPT(GPTConfig.from_preset(name))
    assert model.num_parameters() == GPT2_PARAMETERS[name]


def test_untied_head_adds_one_vocab_matrix():
    with torch.device("meta"):
        tied = GPT(GPTConfig.from_preset("gpt2-small"))
        untied = GPT(GPTConfig.from_preset("gpt2-small", tie_weights=False))
    assert untied.num_parameters() - tied.num_parameters() == 50257 * 768
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_presets_are_valid_and_small_ones_are_small():
    assert {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt-cpu", "gpt-smoke"} <= set(PRESETS)
    smoke, cpu, small = (GPTConfig.from_preset(n) for n in ("gpt-smoke", "gpt-cpu", "gpt2-small"))
    assert smoke.n_layers * smoke.d_model < cpu.n_layers * cpu.d_model < small.n_layers * small.d_model


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="valid presets: gpt2-small, gpt2-medium"):
        GPTConfig.from_preset("gpt3")


def test_overrides_are_validated():
    assert GPTConfig.from_preset("gpt2-small", dropout=0.0).dropout == 0.0
    with pytest.raises(ValueError, match="dropout must be in"):
        GPTConfig.from_preset("gpt2-small", dropout=1.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"d_model": 100, "n_heads": 12}, "divisible by n_heads"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"vocab_size": -1}, "vocab_size must be a positive integer"),
        ({"context_length": 2.5}, "context_length must be a positive integer"),
        ({"dropout": -0.1}, r"dropout must be in \[0, 1\)"),
    ],
)
def test_invalid_configs_say_what_is_wrong(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_ffn_type_is_validated_and_gpt2_presets_stay_gelu():
    assert {GPTConfig.from_preset(name).ffn_type for name in GPT2_PARAMETERS} == {"gelu"}
    assert GPTConfig.from_preset("gpt-smoke", ffn_type="swiglu").ffn_type == "swiglu"
    with pytest.raises(ValueError, match="unknown GPTConfig.ffn_type 'relu'; valid types: gelu, swiglu, moe"):
        GPTConfig(ffn_type="relu")


@pytest.mark.parametrize("name", list(GPT2_PARAMETERS))
def test_swiglu_keeps_the_parameter_count_within_one_percent(name):
    with torch.device("meta"):
        model = GPT(GPTConfig.from_preset(name, ffn_type="swiglu"))
    assert model.num_parameters() == pytest.approx(GPT2_PARAMETERS[name], rel=0.01)
