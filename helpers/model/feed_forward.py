"""The feed-forward types (`GPTConfig.ffn_type`), each one class registered once with what the rest of the code needs.

`helpers.GPT` builds the registered class; `helpers.measure.flops` and the roofline read its matmuls and its
activation; tensor parallelism reads how each of its Linear layers splits; the Hugging Face loaders read its weight
names and the activation's name in each layout. A new type is a `FeedForwardPart` subclass passed to
`register_feed_forward`, and nothing else changes (tests/test_parts.py adds one and checks each of those).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .parts import add_to_registry

if TYPE_CHECKING:  # for annotations only: the config validates ffn_type against this module's registry
    from .config import GPTConfig


@dataclass(frozen=True)
class Matmul:
    """A matmul against a weight, per token: in_features -> out_features, 2·in·out FLOPs in the forward pass.

    Experts: `weights` matrices of that shape, each token through `per_token` of them (a Mixture-of-Experts layer's
    E experts and its top k). Each weight then multiplies only its share of the tokens, so it is read for fewer
    FLOPs than one dense matrix of k times the width would be: the roofline places it lower."""

    label: str  # as the roofline names it
    in_features: int
    out_features: int
    weights: int = 1
    per_token: int = 1

    @property
    def flops_per_token(self) -> int:
        return 2 * self.in_features * self.out_features * self.per_token


@dataclass(frozen=True)
class Elementwise:
    """An elementwise operation, per token: `width` elements out of `inputs` tensors as wide, about
    `flops_per_element` FLOPs each (the roofline places it; the FLOP counts leave it out)."""

    label: str
    flops_per_element: int
    width: int
    run: Callable[..., torch.Tensor]
    inputs: int = 1


@dataclass(frozen=True)
class Split:
    """How Megatron-style tensor parallelism cuts a Linear layer: "column" gives each rank a slice of the output
    features (of each of `parts` blocks stacked in one weight, e.g. gate and up), "row" a slice of the input features,
    the ranks' partial outputs then summed."""

    kind: str  # "column" or "row"
    parts: int = 1


ROW = Split("row")


@dataclass(frozen=True)
class HFLayout:
    """A part's weights in one of Hugging Face's layouts: our Linear layer -> theirs, several of theirs stacked along
    the output features into one of ours (("gate_proj", "up_proj") -> fc), and the names config.json gives its
    activation (every one is accepted on load; the first is written on export)."""

    weights: dict[str, tuple[str, ...]]
    activations: tuple[str, ...]


class FeedForwardPart(nn.Module, ABC):
    """Base of the feed-forward types. A subclass builds itself from a GPTConfig and declares:

    * `name`: its GPTConfig.ffn_type;
    * `hidden_dim(config)`: its hidden width (the default, unless `config.ffn_hidden` sets one);
    * `matmuls(config)` and `elementwise(config)`: its operations per token (FLOPs, roofline);
    * `tensor_parallel`: each Linear layer's `Split`, by attribute name;
    * `hf_layouts`: its weight names in Hugging Face's "gpt2", "llama" or "qwen3_moe" layout (`hf_weights` where
      they depend on the config; `hf_config` and `config_from_hf` for config.json keys of its own);
    * `residual_weights()`: the weights that write into the residual stream (GPT-2 scales their initialisation).
    """

    name: ClassVar[str]
    tensor_parallel: ClassVar[dict[str, Split]]
    hf_layouts: ClassVar[dict[str, HFLayout]]

    @classmethod
    @abstractmethod
    def hidden_dim(cls, config: GPTConfig) -> int: ...

    @classmethod
    @abstractmethod
    def matmuls(cls, config: GPTConfig) -> list[Matmul]: ...

    @classmethod
    @abstractmethod
    def elementwise(cls, config: GPTConfig) -> list[Elementwise]: ...

    @abstractmethod
    def residual_weights(self) -> list[torch.Tensor]: ...

    @classmethod
    def hf_weights(cls, config: GPTConfig, layout: str) -> dict[str, tuple[str, ...]]:
        """Our tensors (names within the part) -> the layout's (names within the block's `mlp.`), whose rows stacked
        make ours: by default each Linear layer's weight (and bias) as `hf_layouts` names them."""
        suffixes = ("weight", "bias") if config.bias else ("weight",)
        return {f"{ours}.{suffix}": tuple(f"{part}.{suffix}" for part in theirs)
                for ours, theirs in cls.hf_layouts[layout].weights.items() for suffix in suffixes}

    @classmethod
    def hf_config(cls, config: GPTConfig, layout: str) -> dict:
        """config.json keys of the part's own, beyond the layout's activation and width."""
        return {}

    @classmethod
    def config_from_hf(cls, hf: dict, layout: str) -> dict:
        """The GPTConfig fields that `hf_config`'s keys set."""
        return {}


FEED_FORWARDS: dict[str, type[FeedForwardPart]] = {}  # GPTConfig.ffn_type -> class, in registration order


def register_feed_forward(part: type[FeedForwardPart]) -> type[FeedForwardPart]:
    """Make `part` a GPTConfig.ffn_type (usable as a class decorator)."""
    return add_to_registry(part, FeedForwardPart, FEED_FORWARDS, "ffn_type", ("name", "tensor_parallel", "hf_layouts"))


def feed_forward_type(config: GPTConfig) -> type[FeedForwardPart]:
    """The registered class of `config.ffn_type`."""
    return FEED_FORWARDS[config.ffn_type]


def in_layout(layout: str) -> dict[str, type[FeedForwardPart]]:
    """The feed-forward types a Hugging Face layout ("gpt2" or "llama") can hold, by name."""
    return {name: part for name, part in FEED_FORWARDS.items() if layout in part.hf_layouts}


def part_with_activation(layout: str, activation: str) -> type[FeedForwardPart] | None:
    """The feed-forward type whose activation a layout's config.json calls `activation`, if one is registered."""
    return next((part for part in in_layout(layout).values() if activation in part.hf_layouts[layout].activations),
                None)


class TwoLayerFeedForward(FeedForwardPart):
    """d -> hidden -> d through an activation: `fc`, then `activation`, then `proj` (GPT-2's MLP is one)."""

    tensor_parallel = {"fc": Split("column"), "proj": ROW}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = self.hidden_dim(config)
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    @staticmethod
    @abstractmethod
    def activation(x: torch.Tensor) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.activation(self.fc(x))))

    @classmethod
    def hidden_dim(cls, config: GPTConfig) -> int:
        return config.ffn_hidden or 4 * config.d_model

    @classmethod
    def matmuls(cls, config: GPTConfig) -> list[Matmul]:
        hidden = cls.hidden_dim(config)
        return [Matmul("feed-forward up", config.d_model, hidden), Matmul("feed-forward down", hidden, config.d_model)]

    def residual_weights(self) -> list[torch.Tensor]:
        return [self.proj.weight]


@register_feed_forward
class FeedForward(TwoLayerFeedForward):
    """Position-wise MLP: d -> 4d -> d with GELU (tanh approximation, as GPT-2 was trained)."""

    name = "gelu"
    # GPT-2's config.json names the tanh-approximated GELU three ways; transformers computes each as this one
    hf_layouts = {"gpt2": HFLayout({"fc": ("c_fc",), "proj": ("c_proj",)},
                                   ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"))}

    @staticmethod
    def activation(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    @classmethod
    def elementwise(cls, config: GPTConfig) -> list[Elementwise]:
        return [Elementwise("GELU", 10, cls.hidden_dim(config), FeedForward.activation)]


def swiglu_hidden_dim(d_model: int, multiple_of: int = 64, tolerance: float = 0.01) -> int:
    """Hidden width h of a SwiGLU feed-forward with the GELU MLP's parameter count: 3·d·h ≈ 8·d², so h ≈ 8d/3.

    The multiple of 64 nearest 8d/3 (matmul-friendly, as LLaMA rounds to a multiple of 256); on small models,
    where that misses the GELU MLP's parameter count (biases included) by more than `tolerance`, the largest
    smaller power-of-two multiple that does not.
    """
    gelu = 8 * d_model**2 + 5 * d_model  # weights and biases of d -> 4d -> d
    while True:
        hidden = max(multiple_of, round(8 * d_model / 3 / multiple_of) * multiple_of)
        swiglu = 3 * d_model * hidden + 2 * hidden + d_model
        if abs(swiglu / gelu - 1) <= tolerance or multiple_of == 1:
            return hidden
        multiple_of //= 2


def silu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@register_feed_forward
class SwiGLUFeedForward(FeedForwardPart):
    """Gated feed-forward (Shazeer 2020; PaLM, LLaMA): proj(silu(x·W_gate) * (x·W_up)), d -> ~8d/3 -> d.

    Three weight matrices instead of two, so the hidden width shrinks from 4d to about 8d/3 and the parameter
    count and FLOPs stay those of GPT-2's MLP (unless `ffn_hidden` sets the width, as real checkpoints do). `fc`
    holds the gate and up projections stacked (one matmul).
    """

    name = "swiglu"
    tensor_parallel = {"fc": Split("column", parts=2), "proj": ROW}  # each rank: its slice of gate and of up
    hf_layouts = {"llama": HFLayout({"fc": ("gate_proj", "up_proj"), "proj": ("down_proj",)}, ("silu",))}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = self.hidden_dim(config)
        self.fc = nn.Linear(config.d_model, 2 * hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    gate = staticmethod(silu_gate)  # what combines the gate and up halves (a gated variant changes this alone)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gate(*self.fc(x).chunk(2, dim=-1))))

    @classmethod
    def hidden_dim(cls, config: GPTConfig) -> int:
        return config.ffn_hidden or swiglu_hidden_dim(config.d_model)

    @classmethod
    def matmuls(cls, config: GPTConfig) -> list[Matmul]:
        hidden = cls.hidden_dim(config)
        return [Matmul("feed-forward gate and up", config.d_model, 2 * hidden),
                Matmul("feed-forward down", hidden, config.d_model)]

    @classmethod
    def elementwise(cls, config: GPTConfig) -> list[Elementwise]:
        return [Elementwise("SiLU(gate) · up", 5, cls.hidden_dim(config), silu_gate, inputs=2)]

    def residual_weights(self) -> list[torch.Tensor]:
        return [self.proj.weight]
