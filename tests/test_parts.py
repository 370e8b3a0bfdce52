"""A new feed-forward type is one class and its registration: tests/example_parts.py adds two that helpers/ does not
know (squared ReLU in GPT-2's layout, GeGLU in Llama's). Registered, each is a config and command-line choice,
trains, has its FLOPs counted exactly (FlopCounterMode is the reference) and placed on the roofline, splits under
tensor parallelism (two processes, against one, in float64), and round-trips through the Hugging Face layout with
transformers' logits."""

import json

import example_parts
import pytest
import torch
from example_parts import EXAMPLES, ReLUSquaredFeedForward, config_for, registered

from helpers.measure.flops import count_with_flop_counter, forward_flops
from helpers.measure.roofline import gpt_operations
from helpers.model.config import GPTConfig
from helpers.model.feed_forward import FEED_FORWARDS, FeedForwardPart, TwoLayerFeedForward, register_feed_forward
from helpers.model.gpt import GPT
from helpers.model.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from helpers.model.hf_llama import load_hf_llama, save_hf_llama
from helpers.parallel.runtime import config_from_flags
from helpers.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, tensor_parallel_gpt
from helpers.training.step import TrainingStep


@pytest.fixture(params=EXAMPLES, ids=lambda part: part.name)
def part(request):
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


def test_it_builds_with_its_hidden_width_and_trains(part):
    config = config_for(part)
    torch.manual_seed(0)
    model = GPT(config)
    assert isinstance(model.blocks[0].mlp, part)
    assert model.blocks[0].mlp.proj.in_features == part.hidden_dim(config)
    x, y = (torch.randint(config.vocab_size, (4, config.context_length)) for _ in range(2))
    step = TrainingStep(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = [step([(x, y)]).loss for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses  # it memorises a fixed batch, as every feed-forward does


def test_its_flops_are_counted_exactly(part):
    config = config_for(part)
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
    return {(row["ffn"], row["path"]): row for row in json.loads(out.read_text())}


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
