"""The position encodings (`GPTConfig.position_encoding`), each one class registered once with what the rest of the
code needs.

Attention weighs its keys as a set, blind to their order (the causal mask alone tells a token how many precede it).
A position encoding adds the order either to the input (GPT-2's learned table, added to the token embeddings) or
inside attention (RoPE rotates queries and keys). `helpers.GPT` builds the table a part declares and passes the
rotation's angles to every attention layer; tensor parallelism keeps both whole on every rank (each rank's heads
rotate by the same angles); the Hugging Face loaders read which layout holds it, its tensors there and its
config.json keys. Neither adds FLOPs to the counts (a table is a lookup, a rotation elementwise). A new encoding is a
`PositionEncodingPart` subclass passed to `register_position_encoding`, and nothing else changes (tests/test_parts.py
adds one and checks each of those).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from .hf_files import WeightsError
from .parts import add_to_registry
from .rope import rope_angles

if TYPE_CHECKING:  # for annotations only: the config validates position_encoding against this module's registry
    from .config import GPTConfig


class PositionEncodingPart:
    """Base of the position encodings. A subclass is never instantiated; it declares:

    * `name`: its GPTConfig.position_encoding;
    * `table(config)`: the learned vectors added to the token embeddings (the model's `pos_emb`), or None. A table
      has a row per position up to the context length and none beyond, so it fixes the context; without one, the
      context length is only the longest sequence the model was trained on;
    * `rotary` and `angles(config, positions)`: whether attention rotates each head's queries and keys, and the
      (cos, sin) of the rotation at these positions (`helpers.model.rope`);
    * `hf_layouts`: the Hugging Face layouts ("gpt2", "llama") that hold it, each with our tensors -> theirs, as the
      layout's loader names them. A layout's architecture fixes its encoding, so a layout holds one at most;
      `hf_config` and `config_from_hf` for config.json keys of its own.
    """

    name: ClassVar[str]
    hf_layouts: ClassVar[dict[str, dict[str, str]]]
    rotary: ClassVar[bool] = False

    @classmethod
    def table(cls, config: GPTConfig) -> nn.Embedding | None:
        return None

    @classmethod
    def hf_config(cls, config: GPTConfig, layout: str) -> dict:
        """config.json keys of its own."""
        return {}

    @classmethod
    def config_from_hf(cls, hf: Mapping, layout: str, source: str = "config.json") -> dict:
        """The GPTConfig fields that `hf_config`'s keys set; what it cannot compute is refused (WeightsError)."""
        return {}


POSITION_ENCODINGS: dict[str, type[PositionEncodingPart]] = {}  # GPTConfig.position_encoding -> class


def register_position_encoding(part: type[PositionEncodingPart]) -> type[PositionEncodingPart]:
    """Make `part` a GPTConfig.position_encoding (usable as a class decorator)."""
    declared = ("name", "hf_layouts") + (("angles",) if getattr(part, "rotary", False) else ())
    return add_to_registry(part, PositionEncodingPart, POSITION_ENCODINGS, "position_encoding", declared,
                           one_per_layout=True)


def position_encoding_type(config: GPTConfig) -> type[PositionEncodingPart]:
    """The registered class of `config.position_encoding`."""
    return POSITION_ENCODINGS[config.position_encoding]


@register_position_encoding
class LearnedPositions(PositionEncodingPart):
    """GPT-2's learned absolute positions: a vector per position, trained like the token embeddings and added to
    them. Positions past the table's last row have no vector, so the model never reads beyond its context."""

    name = "learned"
    hf_layouts = {"gpt2": {"pos_emb.weight": "wpe.weight"}}

    @classmethod
    def table(cls, config: GPTConfig) -> nn.Embedding:
        return nn.Embedding(config.context_length, config.d_model)


@register_position_encoding
class RoPE(PositionEncodingPart):
    """Rotary position embeddings (Su et al. 2021; LLaMA, Qwen, Mistral, Gemma): attention rotates each head's
    queries and keys by angles that grow with the position, so their dot products see relative positions. Nothing
    is learned; the base θ is `GPTConfig.rope_theta`."""

    name = "rope"
    rotary = True
    hf_layouts = {"llama": {}}  # no tensors: θ (and any rescaling) is in config.json

    @classmethod
    def angles(cls, config: GPTConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_angles(positions, config.head_dim, config.rope_theta)

    @classmethod
    def hf_config(cls, config: GPTConfig, layout: str) -> dict:
        return dict(rope_theta=config.rope_theta,
                    rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})

    @classmethod
    def config_from_hf(cls, hf: Mapping, layout: str, source: str = "config.json") -> dict:
        """θ from either spelling (`rope_parameters` since transformers 5, else `rope_theta`/`rope_scaling`); a
        rescaled RoPE (Llama 3.1's "llama3" type, YaRN) is refused by name."""
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise WeightsError(f"{source}: rope_type {kind!r} rescales RoPE's frequencies, which helpers.GPT does not "
                               "do; use transformers for this model")
        return {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
