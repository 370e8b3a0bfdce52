"""Two feed-forward types that helpers/ does not have, each written as a contributor would add one: a class and its
registration, nothing else. tests/test_parts.py checks that everything else follows; run under torchrun (two ranks),
this file compares both split by tensor parallelism with one process, in float64, and rank 0 writes one JSON row per
type and path to the path given."""

import contextlib

import torch
import torch.nn.functional as F

from helpers.model.config import LLAMA_STYLE, GPTConfig
from helpers.model.feed_forward import (
    FEED_FORWARDS,
    Elementwise,
    HFLayout,
    SwiGLUFeedForward,
    TwoLayerFeedForward,
    register_feed_forward,
)
from helpers.model.gpt import GPT


class ReLUSquaredFeedForward(TwoLayerFeedForward):
    """Primer's squared ReLU (So et al. 2021): d -> 4d -> d through relu(x)², in GPT-2's layout."""

    name = "relu2"
    hf_layouts = {"gpt2": HFLayout({"fc": ("c_fc",), "proj": ("c_proj",)}, ("relu2",))}

    @staticmethod
    def activation(x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()

    @classmethod
    def elementwise(cls, config: GPTConfig) -> list[Elementwise]:
        return [Elementwise("ReLU²", 2, cls.hidden_dim(config), ReLUSquaredFeedForward.activation)]


def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


class GeGLUFeedForward(SwiGLUFeedForward):
    """GeGLU (Shazeer 2020; Gemma): SwiGLU with the tanh GELU for SiLU, hidden width 3d, in the Llama layout."""

    name = "geglu"
    gate = staticmethod(gelu_gate)
    hf_layouts = {"llama": HFLayout({"fc": ("gate_proj", "up_proj"), "proj": ("down_proj",)},
                                    ("gelu_pytorch_tanh",))}

    @classmethod
    def hidden_dim(cls, config: GPTConfig) -> int:
        return config.ffn_hidden or 3 * config.d_model

    @classmethod
    def elementwise(cls, config: GPTConfig) -> list[Elementwise]:
        return [Elementwise("GELU(gate) · up", 11, cls.hidden_dim(config), gelu_gate, inputs=2)]


EXAMPLES = (ReLUSquaredFeedForward, GeGLUFeedForward)


def config_for(part) -> GPTConfig:
    """A tiny model in the Hugging Face layout the part has: GPT-2's, or Llama's (RMSNorm, RoPE, no biases)."""
    style = {} if "gpt2" in part.hf_layouts else LLAMA_STYLE
    return GPTConfig(vocab_size=61, context_length=16, d_model=48, n_heads=4, n_layers=2, dropout=0.0,
                     **{**style, "ffn_type": part.name})


@contextlib.contextmanager
def registered(part):
    """`part` is a GPTConfig.ffn_type inside the block, and no longer after it."""
    register_feed_forward(part)
    try:
        yield part
    finally:
        del FEED_FORWARDS[part.name]


def main() -> None:
    from distributed_paths import dtensor, finish, reference, tensor_parallel  # beside this file: every path's

    from helpers.parallel.runtime import max_over_ranks, setup

    runtime = setup("cpu", timeout_s=120)
    rows = []
    for part in EXAMPLES:
        register_feed_forward(part)
        torch.manual_seed(0)
        config = config_for(part)
        base = GPT(config).double()
        x, y = (torch.randint(config.vocab_size, (3, config.context_length)) for _ in range(2))
        ref_logits, ref_grads = reference(base, x, y)
        for path, run in (("tensor_parallel", tensor_parallel), ("dtensor", dtensor)):
            output, grads = run(base, x, y, ref_logits, ref_grads, runtime)
            rows.append({"ffn": part.name, "path": path, "output_diff": max_over_ranks(output, runtime.device),
                         "grad_diff": max_over_ranks(grads, runtime.device)})
    finish(rows, runtime)


if __name__ == "__main__":
    main()
