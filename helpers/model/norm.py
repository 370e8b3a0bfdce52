"""The norms (`GPTConfig.norm`), each one class registered once with what the rest of the code needs.

`helpers.GPT` builds the registered class for every norm of the model (each block's two and the final one);
`helpers.measure.roofline` places it by its FLOPs per element (the FLOP counts leave it out: it has no matmul);
tensor parallelism keeps it whole on every rank (it sees the same activations there); the Hugging Face loaders read
which layout holds it and its ε's config.json key. A new norm is a `NormPart` subclass passed to `register_norm`,
and nothing else changes (tests/test_parts.py adds one and checks each of those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from .parts import add_to_registry

if TYPE_CHECKING:  # for annotations only: the config validates norm against this module's registry
    from .config import GPTConfig


@dataclass(frozen=True)
class NormLayout:
    """A norm in one of Hugging Face's layouts: the config.json key of its ε, and the ε transformers takes when the
    key is absent. The layout names its tensors as we do (`weight`, `bias`), under its own module names."""

    eps_key: str
    default_eps: float


class NormPart(nn.Module):
    """Base of the norms: an nn.Module over the last dimension (d_model) that a subclass builds from a GPTConfig
    (its `__init__(config)`), declaring:

    * `name`: its GPTConfig.norm;
    * `flops_per_element`: about how many FLOPs it spends per element it normalises (the roofline places it);
    * `hf_layouts`: the Hugging Face layouts ("gpt2", "llama") that hold it. A layout's architecture fixes its norm
      (config.json names none), so a layout holds one norm at most.
    """

    name: ClassVar[str]
    flops_per_element: ClassVar[int]
    hf_layouts: ClassVar[dict[str, NormLayout]]

    @classmethod
    def parameter_names(cls, config: GPTConfig) -> list[str]:
        """Its parameters' names, in order (the loaders map them): read from one built on the meta device, so they
        are always the module's own."""
        with torch.device("meta"):
            return [name for name, _ in cls(config).named_parameters()]


NORMS: dict[str, type[NormPart]] = {}  # GPTConfig.norm -> class, in registration order


def register_norm(part: type[NormPart]) -> type[NormPart]:
    """Make `part` a GPTConfig.norm (usable as a class decorator)."""
    return add_to_registry(part, NormPart, NORMS, "norm", ("name", "flops_per_element", "hf_layouts"),
                           one_per_layout=True)


def norm_type(config: GPTConfig) -> type[NormPart]:
    """The registered class of `config.norm`."""
    return NORMS[config.norm]


@register_norm
class LayerNorm(NormPart, nn.LayerNorm):
    """GPT-2's LayerNorm (Ba et al. 2016): subtract the mean, divide by the standard deviation, then scale and shift
    (a bias unless `config.bias` is off)."""

    name = "layernorm"
    flops_per_element = 8
    hf_layouts = {"gpt2": NormLayout("layer_norm_epsilon", 1e-5)}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.d_model, eps=config.norm_eps, bias=config.bias)


@register_norm
class RMSNorm(NormPart, nn.RMSNorm):
    """RMSNorm (Zhang & Sennrich 2019; LLaMA, Qwen, Gemma): divide by the root mean square, then scale. No mean, no
    bias: one reduction fewer than LayerNorm, which its paper found trains as well."""

    name = "rmsnorm"
    flops_per_element = 4
    # Llama's layout, and Qwen3's and Qwen3-MoE's, which share its norms (helpers.model.hf_llama)
    hf_layouts = {"llama": NormLayout("rms_norm_eps", 1e-6)}

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config.d_model, eps=config.norm_eps)
