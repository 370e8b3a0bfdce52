"""A new part is one class and its registration: tests/example_parts.py adds four that helpers/ does not know
(feed-forward types: squared ReLU in GPT-2's layout, GeGLU in Llama's; a norm, ScaleNorm; a position encoding, none
at all). Registered, each is a config and command-line choice, trains, has its FLOPs counted exactly
(FlopCounterMode is the reference) and splits under tensor parallelism (two processes, against one, in float64). A
feed-forward type's matmuls and activation are placed on the roofline, and it round-trips through the Hugging Face
layout with transformers' logits; a norm is placed on the roofline too, and a part that no Hugging Face layout holds
is refused by both loaders, saying what they hold."""

import dataclasses
import json

import example_parts
import pytest
import torch
from example_parts import (
    EXAMPLES,
    FEED_FORWARD_EXAMPLES,
    NoPE,
    ReLUSquaredFeedForward,
    ScaleNorm,
    config_for,
    kind_of,
    registered,
)

from helpers.measure.flops import count_with_flop_counter, forward_flops
from helpers.measure.roofline import gpt_operations
from helpers.model.config import LLAMA_STYLE, GPTConfig
from helpers.model.feed_forward import FEED_FORWARDS, FeedForwardPart, TwoLayerFeedForward, register_feed_forward
from helpers.model.gpt import GPT
from helpers.model.hf_files import WeightsError
from helpers.model.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from helpers.model.hf_llama import load_hf_llama, save_hf_llama
from helpers.model.norm import NORMS, NormPart, register_norm
from helpers.model.position_encoding import POSITION_ENCODINGS, PositionEncodingPart, register_position_encoding
from helpers.parallel.runtime import config_from_flags
from helpers.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tensor_parallel_gpt
from helpers.training.step import TrainingStep


@pytest.fixture(params=FEED_FORWARD_EXAMPLES, ids=lambda part: part.name)
def part(request):
    with registered(request.param) as part:
        yield part


@pytest.fixture(params=EXAMPLES, ids=lambda part: part.name)
def any_part(request):
    with registered(request.param) as part:
        yield part


def test_a_type_is_a_choice_only_while_registered():
    name = ReLUSquaredFeedForward.name
    with registered(ReLUSquaredFeedForward):
        assert GPTConfig(ffn_type=name).ffn_type == name
        assert config_from_flags(["--ffn", name]).ffn_type == name
    assert name not in FEED_FORWARDS
    with pytest.raises(ValueError, match=f"unknown GPTConfig.ffn_type '{name}'; valid types: gelu, swiglu, moe"):
        GPTConfig(ffn_type=name)


def test_registration_refuses_a_taken_name_and_an_incomplete_type():
    with registered(ReLUSquaredFeedForward), pytest.raises(ValueError, match="'relu2' is taken by ReLUSquared"):
        register_feed_forward(ReLUSquaredFeedForward)

    class NoActivation(TwoLayerFeedForward):
        name = "nothing"
        hf_layouts = {}

    with pytest.raises(TypeError, match="must subclass FeedForwardPart .* missing: activation, elementwise"):
        register_feed_forward(NoActivation)
    with pytest.raises(TypeError, match="missing: name, hf_layouts"):
        register_feed_forward(type("Nameless", (FeedForwardPart,), {"tensor_parallel": {}}))


@pytest.mark.parametrize("part", [ScaleNorm, NoPE], ids=lambda part: part.name)
def test_a_norm_or_position_encoding_is_a_choice_only_while_registered(part):
    field, _, _ = kind_of(part)
    flag = "--" + field.replace("_", "-")
    with registered(part):
        assert getattr(GPTConfig(**{field: part.name}), field) == part.name
        assert getattr(config_from_flags([flag, part.name]), field) == part.name
    valid = {"norm": "layernorm, rmsnorm", "position_encoding": "learned, rope"}[field]
    with pytest.raises(ValueError, match=f"unknown GPTConfig.{field} '{part.name}'; valid types: {valid}$"):
        GPTConfig(**{field: part.name})
    with pytest.raises(SystemExit):
        config_from_flags([flag, part.name])


def test_norm_and_position_registration_refuses_a_taken_name_or_layout_and_an_incomplete_part():
    with registered(ScaleNorm), pytest.raises(ValueError, match="norm 'scalenorm' is taken by ScaleNorm"):
        register_norm(ScaleNorm)
    with registered(NoPE), pytest.raises(ValueError, match="position_encoding 'none' is taken by NoPE"):
        register_position_encoding(NoPE)
    gpt2_norm = type("GPT2Norm", (ScaleNorm,), {"name": "gpt2norm", "hf_layouts": {"gpt2": None}})
    with pytest.raises(ValueError, match="the gpt2 layout holds norm 'layernorm' already"):
        register_norm(gpt2_norm)
    llama_positions = type("Alibi", (NoPE,), {"name": "alibi", "hf_layouts": {"llama": {}}})
    with pytest.raises(ValueError, match="the llama layout holds position_encoding 'rope' already"):
        register_position_encoding(llama_positions)
    with pytest.raises(TypeError, match="must subclass NormPart .* missing: flops_per_element"):
        register_norm(type("Unmeasured", (NormPart,), {"name": "unmeasured", "hf_layouts": {}}))
    with pytest.raises(TypeError, match="must subclass PositionEncodingPart .* missing: angles"):
        register_position_encoding(type("Spin", (PositionEncodingPart,), {"name": "spin", "hf_layouts": {},
                                                                          "rotary": True}))
    assert "unmeasured" not in NORMS and "spin" not in POSITION_ENCODINGS


def test_it_builds_with_its_hidden_width(part):
    config = config_for(part)
    model = GPT(config)
    assert isinstance(model.blocks[0].mlp, part)
    assert model.blocks[0].mlp.proj.in_features == part.hidden_dim(config)


def test_the_model_builds_the_norm_everywhere_and_the_encoding_adds_nothing():
    with registered(ScaleNorm), registered(NoPE):
        model = GPT(GPTConfig(vocab_size=61, context_length=16, d_model=48, n_heads=4, n_layers=2, norm="scalenorm",
                              position_encoding="none"))
    norms = [model.ln_f] + [norm for block in model.blocks for norm in (block.ln1, block.ln2)]
    assert all(isinstance(norm, ScaleNorm) for norm in norms)
    assert ScaleNorm.parameter_names(model.config) == ["scale"]
    assert model.pos_emb is None and "pos_emb.weight" not in model.state_dict()


def test_it_trains(any_part):
    config = config_for(any_part)
    torch.manual_seed(0)
    model = GPT(config)
    x, y = (torch.randint(config.vocab_size, (4, config.context_length)) for _ in range(2))
    step = TrainingStep(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = [step([(x, y)]).loss for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses  # it memorises a fixed batch, as every model here does


def test_its_flops_are_counted_exactly(any_part):
    config = config_for(any_part)
    model = GPT(config)
    counted = count_with_flop_counter(model, torch.zeros(2, 16, dtype=torch.long))
    analytic = forward_flops(config, 2, 16)
    assert counted.by_part()["feed_forward"] == analytic.mlp > 0
    assert counted.total == analytic.total()


def test_the_roofline_runs_its_matmuls_and_activation(part):
    config = config_for(part)
    ops = {op.name: op for op in gpt_operations(config, 2, 8)}
    matmuls, elementwise = part.matmuls(config), part.elementwise(config)
    assert sum(ops[m.label].flops for m in matmuls) == forward_flops(config, 2, 8).mlp // config.n_layers
    for declared in elementwise:
        op = ops[declared.label]
        assert op.kind == "elementwise" and op.flops == declared.flops_per_element * 16 * part.hidden_dim(config)
    for label in [m.label for m in matmuls] + [e.label for e in elementwise]:
        assert ops[label].make()().shape[0] == 16  # its inputs have the shapes it declares


def test_the_roofline_runs_the_norm():
    with registered(ScaleNorm):
        config = config_for(ScaleNorm)
        op = {op.name: op for op in gpt_operations(config, 2, 8)}["ScaleNorm"]
    assert op.kind == "elementwise" and op.flops == ScaleNorm.flops_per_element * 16 * config.d_model
    assert op.make()().shape == (16, config.d_model)


def test_its_layers_split_as_it_declares(part):
    model = GPT(config_for(part))
    rank0 = tensor_parallel_gpt(model, rank=0, world_size=2)
    for block, full in zip(rank0.blocks, model.blocks, strict=True):
        assert isinstance(block.mlp.fc, ColumnParallelLinear) and isinstance(block.mlp.proj, RowParallelLinear)
        assert block.mlp.fc.weight.shape[0] * 2 == full.mlp.fc.weight.shape[0]  # half of each stacked part's rows
        assert block.mlp.proj.weight.shape[1] * 2 == full.mlp.proj.weight.shape[1]


@pytest.fixture(scope="module")
def split_rows(torchrun, tmp_path_factory):
    out = tmp_path_factory.mktemp("parts") / "rows.json"
    torchrun(example_parts.__file__, [out], nproc=2, timeout=240)
    return {(row["part"], row["path"]): row for row in json.loads(out.read_text())}


@pytest.mark.parametrize("path", ["tensor_parallel", "dtensor"])
@pytest.mark.parametrize("name", [part.name for part in EXAMPLES])
def test_it_splits_under_tensor_parallelism(split_rows, name, path):
    row = split_rows[name, path]
    assert row["output_diff"] < 1e-12 and row["grad_diff"] < 1e-12, row


def test_it_round_trips_through_the_hugging_face_layout(part, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = config_for(part)
    torch.manual_seed(0)
    ours = GPT(config).double().eval()
    layout = "gpt2" if "gpt2" in part.hf_layouts else "llama"
    (save_hf_gpt2 if layout == "gpt2" else save_hf_llama)(ours, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    activation = saved["activation_function" if layout == "gpt2" else "hidden_act"]
    assert activation == part.hf_layouts[layout].activations[0]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).double().eval()
    idx = torch.randint(0, config.vocab_size, (2, 11))
    tolerance = 1e-10 if layout == "gpt2" else 1e-6  # transformers computes RoPE's angles in float32
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=tolerance)
    again = (load_hf_gpt2 if layout == "gpt2" else load_hf_llama)(tmp_path)
    assert again.config.ffn_type == part.name
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


@pytest.mark.parametrize(("part", "llama_needs"), [(ScaleNorm, r"RMSNorm \(norm='rmsnorm'\)"),
                                                   (NoPE, r"RoPE \(position_encoding='rope'\)")],
                         ids=lambda value: getattr(value, "name", ""))
def test_a_part_no_layout_holds_is_refused_by_both_loaders(part, llama_needs, tmp_path):
    field, _, _ = kind_of(part)
    with registered(part):
        gpt2 = GPT(config_for(part))
        llama = GPT(dataclasses.replace(config_for(part), **{**LLAMA_STYLE, field: part.name}))
        with pytest.raises(WeightsError, match=f"no Hugging Face layout has tensor names for {field}='{part.name}'"):
            save_hf_gpt2(gpt2, tmp_path)
        with pytest.raises(WeightsError, match=f"the Llama/Qwen3 layout needs {llama_needs}"):
            save_hf_llama(llama, tmp_path)
    assert not any(tmp_path.iterdir())
