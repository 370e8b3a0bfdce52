"""LoRA (Hu et al. 2021): fine-tune a frozen weight W through a low-rank update, W + (alpha / r) · B·A.

A is (r, in) and B is (out, r), so a layer trains r·(in + out) numbers instead of in·out, and the optimizer keeps
state for those alone. B starts at zero, so the model is unchanged at step 0; A starts random, so B's gradient is
not zero. After training the update folds into W (`merge_lora`): the merged model is a plain GPT again and runs
at the base model's speed. The adapter alone (A and B of every layer, plus how they were made) is a file of
kilobytes to megabytes (`save_adapter`, `load_adapter`). Over an int8 base (`helpers.inference.quantization`)
the frozen weights take a quarter of the memory: the QLoRA idea, with int8 for NF4.

Tokens added for fine-tuning (the chat markers, `helpers.text.chat`) start with rows the model never learned, and
no update of the blocks gives a token an embedding or an output row of its own: `add_lora(..., train_tokens=ids)`
trains those rows too (`TokenRows`, PEFT's "trainable tokens"), and nothing else of the embedding.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
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


class TokenRows(nn.Module):
    """A frozen embedding (or LM head) of which the rows of `tokens` train: those rows are a parameter of their own,
    written over the frozen matrix (`weight`), so the optimizer keeps state for them alone."""

    def __init__(self, base: nn.Embedding | nn.Linear, tokens: Sequence[int]) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.register_buffer("tokens", torch.tensor(sorted(set(tokens)), device=base.weight.device))
        self.trained = nn.Parameter(base.weight.detach()[self.tokens].clone())

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight.index_copy(0, self.tokens, self.trained)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.base, nn.Embedding):
            return F.embedding(x, self.weight)
        return F.linear(x, self.weight, self.base.bias)

    def merged(self) -> nn.Embedding | nn.Linear:
        """The frozen module with the trained rows written in (in place: a weight tied to it follows)."""
        with torch.no_grad():
            self.base.weight.index_copy_(0, self.tokens, self.trained)
        return self.base


class TiedHead(nn.Module):
    """The LM head of a model whose head is its embedding (GPT-2's tied weights), over that embedding's
    `TokenRows`: the trained rows are one parameter for both."""

    def __init__(self, base: nn.Linear, embedding: TokenRows) -> None:
        super().__init__()
        self.base, self.embedding = base, embedding

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.base.bias)

    def merged(self) -> nn.Linear:
        return self.base  # its weight is the embedding's, merged with it


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: Iterable[str] = BLOCK_PROJECTIONS, train_tokens: Iterable[int] = ()) -> nn.Module:
    """Freeze every parameter of `model` and wrap the Linear layers named by `targets` (a name's last parts:
    "attn.qkv" adapts every block's fused Q, K, V projection) in `LoRALinear`; with `train_tokens`, the embedding
    and LM-head rows of those token ids train too (`TokenRows`). In place; returns the model."""
    targets = tuple(targets)
    refuse_a_second_adapter(model)
    layers = linear_layers(model)
    chosen = [name for name in layers if any(name == t or name.endswith("." + t) for t in targets)]
    if not chosen:
        raise ValueError(f"no Linear layer of the model is named ...{', ...'.join(targets)}; its layers end with "
                         f"{', '.join(sorted({n.split('.', 2)[-1] for n in layers}))}")
    wrap(model, chosen, rank, alpha, dropout)
    return train_token_rows(model, train_tokens)


def train_token_rows(model: nn.Module, tokens: Iterable[int]) -> nn.Module:
    """Let the embedding and LM-head rows of `tokens` train (a GPT's `tok_emb` and `lm_head`, tied or not)."""
    tokens = sorted(set(tokens))
    if not tokens:
        return model
    vocab = model.tok_emb.num_embeddings
    if tokens[0] < 0 or tokens[-1] >= vocab:
        raise ValueError(f"train_tokens must be token ids of the model's vocabulary, 0 to {vocab - 1}; got {tokens}")
    tied = model.lm_head.weight is model.tok_emb.weight
    model.tok_emb = TokenRows(model.tok_emb, tokens)
    model.lm_head = TiedHead(model.lm_head, model.tok_emb) if tied else TokenRows(model.lm_head, tokens)
    return model


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, (nn.Linear, Int8Linear))}


def refuse_a_second_adapter(model: nn.Module) -> None:
    if lora_layers(model) or token_rows(model):
        raise ValueError("the model already has LoRA layers: merge them (merge_lora) before adding others")


def wrap(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float) -> nn.Module:
    model.requires_grad_(False)
    for name in names:
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, LoRALinear(model.get_submodule(name), rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def token_rows(model: nn.Module) -> dict[str, TokenRows | TiedHead]:
    return {name: module for name, module in model.named_modules() if isinstance(module, (TokenRows, TiedHead))}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its layer (a plain Linear again) and the trained token rows into the embedding,
    and make every parameter of the model trainable, as a plain GPT trains. In place; returns the model."""
    for name, layer in (lora_layers(model) | token_rows(model)).items():
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, layer.merged())
    return model.requires_grad_(True)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' A and B of every LoRA layer, and the trained token rows, by parameter name: what fine-tuning
    changed."""
    rows = {f"{name}.trained": layer.trained.detach() for name, layer in token_rows(model).items()
            if isinstance(layer, TokenRows)}
    return {f"{name}.{p}": getattr(layer, p).detach() for name, layer in lora_layers(model).items()
            for p in ("lora_a", "lora_b")} | rows


def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the adapters (not the model) to a safetensors file, with the rank, alpha and layers that made them;
    replaced atomically."""
    layers = lora_layers(model)
    if not layers:
        raise ValueError("the model has no LoRA layers to save; call add_lora first")
    first = next(iter(layers.values()))
    rows = token_rows(model)
    tokens = next(iter(rows.values())).tokens.tolist() if rows else []
    settings = {"rank": first.rank, "alpha": first.alpha, "targets": sorted(layers), "train_tokens": tokens}
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
    tokens = settings.get("train_tokens", [])
    if tokens:
        rows = (len(tokens), model.tok_emb.embedding_dim)
        tied = model.lm_head.weight is model.tok_emb.weight
        expected |= {"tok_emb.trained": rows} | ({} if tied else {"lm_head.trained": rows})
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in expected.keys() & tensors.keys() if tuple(tensors[k].shape) != expected[k])
    if missing or unexpected or wrong:
        raise ValueError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                         f"wrong shape {wrong[:3]}; load it into the base model it was trained on")
    wrap(model, settings["targets"], settings["rank"], settings["alpha"], dropout=0.0)
    train_token_rows(model, tokens)
    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            layer.lora_a.copy_(tensors[f"{name}.lora_a"])
            layer.lora_b.copy_(tensors[f"{name}.lora_b"])
        for name, layer in token_rows(model).items():
            if isinstance(layer, TokenRows):
                layer.trained.copy_(tensors[f"{name}.trained"])
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
