"""LoRA (Hu et al. 2021): fine-tune a frozen weight W through a low-rank update, W + (alpha / r) · B·A.

A is (r, in) and B is (out, r), so a layer trains r·(in + out) numbers instead of in·out, and the optimizer keeps
state for those alone. B starts at zero, so the model is unchanged at step 0; A starts random, so B's gradient is
not zero. After training the update folds into W (`merge_lora`): the merged model is a plain GPT again and runs
at the base model's speed. The adapter alone (A and B of every layer, plus how they were made) is a file of
kilobytes to megabytes (`save_adapter`, `load_adapter`). Over an int8 base (`helpers.inference.quantization`)
the frozen weights take a quarter of the memory: the QLoRA idea, with int8 for NF4.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..inference.quantization import Int8Linear
from ..system.files import atomic_path

BLOCK_PROJECTIONS = ("attn.qkv", "attn.out_proj", "mlp.fc", "mlp.proj")  # every Linear layer of a block
ADAPTER_SETTINGS = "helpers.lora"  # safetensors metadata key: rank, alpha and the adapted layers


class LoRALinear(nn.Module):
    """A frozen Linear layer (float or `Int8Linear`) plus a trainable low-rank update, scaled by alpha / rank.

    `weight` is the effective W + (alpha / r)·B·A, for the attention kernels that read a layer's weight rather
    than call it; `forward` adds x·Aᵀ·Bᵀ to the frozen layer's output without forming it. Dropout, on the input
    of the update only, applies in `forward`.
    """

    def __init__(self, base: nn.Linear | Int8Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
        self.base = base.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.in_features, self.out_features = base.in_features, base.out_features
        held = base.scale if isinstance(base, Int8Linear) else base.weight  # an int8 layer computes in its scales'
        factory = {"device": held.device, "dtype": held.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **factory))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear initialises its weight
        self.dropout = nn.Dropout(dropout)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight + self.scaling * (self.lora_b @ self.lora_a)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b)

    def merged(self) -> nn.Linear:
        """A plain Linear computing what this layer does (without dropout): W + (alpha / r)·B·A, the bias as it was.
        Over an int8 base, the merged weight is the float one the int8 values stand for, plus the update."""
        with torch.no_grad():
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                               device=self.lora_a.device, dtype=self.lora_a.dtype)
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}"


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: Iterable[str] = BLOCK_PROJECTIONS) -> nn.Module:
    """Freeze every parameter of `model` and wrap the Linear layers named by `targets` (a name's last parts:
    "attn.qkv" adapts every block's fused Q, K, V projection) in `LoRALinear`. In place; returns the model."""
    targets = tuple(targets)
    refuse_a_second_adapter(model)
    layers = linear_layers(model)
    chosen = [name for name in layers if any(name == t or name.endswith("." + t) for t in targets)]
    if not chosen:
        raise ValueError(f"no Linear layer of the model is named ...{', ...'.join(targets)}; its layers end with "
                         f"{', '.join(sorted({n.split('.', 2)[-1] for n in layers}))}")
    return wrap(model, chosen, rank, alpha, dropout)


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, (nn.Linear, Int8Linear))}


def refuse_a_second_adapter(model: nn.Module) -> None:
    if lora_layers(model):
        raise ValueError("the model already has LoRA layers: merge them (merge_lora) before adding others")


def wrap(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float) -> nn.Module:
    model.requires_grad_(False)
    for name in names:
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, LoRALinear(model.get_submodule(name), rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its layer (a plain Linear again) and make every parameter of the model trainable,
    as a plain GPT trains. In place; returns the model."""
    for name, layer in lora_layers(model).items():
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, layer.merged())
    return model.requires_grad_(True)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' A and B of every LoRA layer, by parameter name: what fine-tuning changed."""
    return {f"{name}.{p}": getattr(layer, p).detach() for name, layer in lora_layers(model).items()
            for p in ("lora_a", "lora_b")}


def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the adapters (not the model) to a safetensors file, with the rank, alpha and layers that made them;
    replaced atomically."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA layers to save; call add_lora first")
    first = next(iter(layers.values()))
    settings = {"rank": first.rank, "alpha": first.alpha, "targets": sorted(layers)}
    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: t.contiguous().cpu() for k, t in adapter_state_dict(model).items()}, tmp,
                  metadata={"format": "pt", ADAPTER_SETTINGS: json.dumps(settings)})
    return path


def load_adapter(model: nn.Module, path: str | os.PathLike) -> nn.Module:
    """Add LoRA layers to the (base) model as the file's settings say and load its adapters into them; every
    tensor must match a layer and every layer get one, or nothing changes. In place; returns the model."""
    refuse_a_second_adapter(model)
    with safe_open(Path(path), framework="pt", device="cpu") as f:
        settings = json.loads((f.metadata() or {}).get(ADAPTER_SETTINGS, "null") or "null")
        if settings is None:
            raise ValueError(f"{path} is not a LoRA adapter saved by save_adapter (no {ADAPTER_SETTINGS} metadata)")
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    layers = linear_layers(model)
    expected = {}
    for name in settings["targets"]:
        if name not in layers:
            raise ValueError(f"{path} adapts a layer this model lacks, {name!r}: it was trained on another model")
        expected |= {f"{name}.lora_a": (settings["rank"], layers[name].in_features),
                     f"{name}.lora_b": (layers[name].out_features, settings["rank"])}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in expected.keys() & tensors.keys() if tuple(tensors[k].shape) != expected[k])
    if missing or unexpected or wrong:
        raise ValueError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                         f"wrong shape {wrong[:3]}; load it into the base model it was trained on")
    wrap(model, settings["targets"], settings["rank"], settings["alpha"], dropout=0.0)
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            layer.lora_a.copy_(tensors[f"{name}.lora_a"])
            layer.lora_b.copy_(tensors[f"{name}.lora_b"])
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
