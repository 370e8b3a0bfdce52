"""The peer: transformers' GPT2LMHeadModel with our model's configuration and weights, so a speed comparison
runs the same function on the same batches (their losses must agree within the rounding of the settings)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from ..model.attention import IMPLEMENTATIONS
from ..model.gpt import GPT
from ..model.hf_gpt2 import hf_config_dict, hf_state_dict
from ..system.optional import require

# our attention implementations that transformers' GPT-2 also has, under its names (each backend says)
PEER_ATTENTION = {name: b.transformers_name for name, b in IMPLEMENTATIONS.items() if b.transformers_name}


def _import_transformers() -> ModuleType:
    return require("transformers", "the comparison with transformers' GPT-2")


def transformers_peer(model: GPT, attn_implementation: str | None = None) -> nn.Module:
    """transformers' GPT2LMHeadModel with `model`'s configuration and weights, no KV cache (training).

    attn_implementation: one of PEER_ATTENTION (default: the one `model` uses).
    """
    transformers = _import_transformers()
    name = attn_implementation or model.attn_implementation
    if name not in PEER_ATTENTION:
        raise ValueError(f"transformers' GPT-2 has no attention implementation like {name!r}; "
                         f"use one of {', '.join(PEER_ATTENTION)}")
    config = transformers.GPT2Config(**hf_config_dict(model.config), use_cache=False,
                                     attn_implementation=PEER_ATTENTION[name])
    device = next(model.parameters()).device
    peer = transformers.GPT2LMHeadModel(config)
    missing, unexpected = peer.load_state_dict(hf_state_dict(model), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied LM head is the embedding, not a tensor of its own
        raise RuntimeError(f"weights did not map onto GPT2LMHeadModel: missing {missing}, unexpected {unexpected}")
    return peer.to(device).train(model.training)


def gpt_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(idx)


def peer_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(input_ids=idx).logits
