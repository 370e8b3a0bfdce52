"""Parts that helpers/ does not have, each written as a contributor would add one: a class and its registration,
nothing else. Two feed-forward types, a norm and a position encoding. tests/test_parts.py checks that everything else
follows; run under torchrun (two ranks), this file compares each split by tensor parallelism with one process, in
float64, and rank 0 writes one JSON row per part and path to the path given."""

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from helpers.model.config import LLAMA_STYLE, GPTConfig
from helpers.model.feed_forward import (
    FEED_FORWARDS,
    Elementwise,
    FeedForwardPart,
    HFLayout,
    SwiGLUFeedForward,
    TwoLayerFeedForward,
    register_feed_forward,
)
from helpers.model.gpt import GPT
from helpers.model.norm import NORMS, NormPart, register_norm
from helpers.model.position_encoding import POSITION_ENCODINGS, PositionEncodingPart, register_position_encoding


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


class ScaleNorm(NormPart):
    """ScaleNorm (Nguyen & Salazar 2019): x scaled to length g, one learned scalar for the whole layer (initialised
    to √d_model, the length of a vector of ones), where LayerNorm learns a gain and a bias per feature."""

    name = "scalenorm"
    flops_per_element = 4  # square, sum, divide, scale
    hf_layouts = {}  # no Hugging Face layout has one

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.eps = config.norm_eps
        self.scale = nn.Parameter(torch.tensor(config.d_model**0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.scale / x.norm(dim=-1, keepdim=True).clamp_min(self.eps))


class NoPE(PositionEncodingPart):
    """No position encoding (Haviv et al. 2022; Kazemnejad et al. 2023): a causal decoder still tells positions apart,
    since the token at position t attends over t + 1 tokens, and learns to."""

    name = "none"
    hf_layouts = {}  # GPT-2's layout always has a position table, Llama's always rotates


FEED_FORWARD_EXAMPLES = (ReLUSquaredFeedForward, GeGLUFeedForward)
EXAMPLES = (*FEED_FORWARD_EXAMPLES, ScaleNorm, NoPE)
KINDS = {  # each kind of part: its GPTConfig field, its registration, its registry
    FeedForwardPart: ("ffn_type", register_feed_forward, FEED_FORWARDS),
    NormPart: ("norm", register_norm, NORMS),
    PositionEncodingPart: ("position_encoding", register_position_encoding, POSITION_ENCODINGS),
}


def kind_of(part) -> tuple:
    """The part's GPTConfig field, its registration function and its registry."""
    return next(kind for base, kind in KINDS.items() if issubclass(part, base))


def config_for(part) -> GPTConfig:
    """A tiny model with the part, in the Hugging Face layout it has: Llama's (RMSNorm, RoPE, no biases), else
    GPT-2's."""
    style = LLAMA_STYLE if "llama" in part.hf_layouts else {}
    return GPTConfig(vocab_size=61, context_length=16, d_model=48, n_heads=4, n_layers=2, dropout=0.0,
                     **{**style, kind_of(part)[0]: part.name})


@contextlib.contextmanager
def registered(part):
    """`part` is a choice of its GPTConfig field inside the block, and no longer after it."""
    _, register, registry = kind_of(part)
    register(part)
    try:
        yield part
    finally:
        del registry[part.name]


def main() -> None:
    from distributed_paths import dtensor, finish, reference, tensor_parallel  # beside this file: every path's

    from helpers.parallel.runtime import max_over_ranks, setup

    runtime = setup("cpu", timeout_s=120)
    rows = []
    for part in EXAMPLES:
        _, register, _ = kind_of(part)
        register(part)
        torch.manual_seed(0)
        config = config_for(part)
        base = GPT(config).double()
        x, y = (torch.randint(config.vocab_size, (3, config.context_length)) for _ in range(2))
        ref_logits, ref_grads = reference(base, x, y)
        for path, run in (("tensor_parallel", tensor_parallel), ("dtensor", dtensor)):
            output, grads = run(base, x, y, ref_logits, ref_grads, runtime)
            rows.append({"part": part.name, "path": path, "output_diff": max_over_ranks(output, runtime.device),
                         "grad_diff": max_over_ranks(grads, runtime.device)})
    finish(rows, runtime)


if __name__ == "__main__":
    main()
