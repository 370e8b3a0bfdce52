"""LoRA (Hu et al. 2021): fine-tune a frozen weight W through a low-rank update, W + (alpha / r) · B·A.

A is (r, in) and B is (out, r), so a layer trains r·(in + out) numbers instead of in·out, and the optimizer keeps
state for those alone. B starts at zero, so the model is unchanged at step 0; A starts random, so B's gradient is
not zero. After training the update folds into W (`merge_lora`): the merged model is a plain GPT again and runs
at the base model's speed. The adapter alone (A and B of every layer, plus how they were made) is a file of
kilobytes to megabytes (`save_adapter`, `load_adapter`). Over an int8 base (`helpers.inference.quantization`)
the frozen weights take a quarter of the memory: the QLoRA idea, with int8 for NF4.

The vocabulary matrix (the token embedding, and the LM head tied to it) is not a block's Linear layer, and it is
where a fine-tune's new words and new tokens live. `add_lora(..., targets=(..., "tok_emb"))` gives it a LoRA update
of its own, one for the embedding and the tied head; `train_tokens=ids` trains its rows of the tokens added for
fine-tuning (the chat markers, `helpers.text.chat`), which start as rows the model never learned and which a
low-rank update can move in its r directions only (PEFT's "trainable tokens"). Both are an `EmbeddingAdapter`.
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
VOCABULARY_MATRICES = ("tok_emb", "lm_head")  # a GPT's token embedding and LM head: one matrix when tied
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


class EmbeddingAdapter(nn.Module):
    """What fine-tuning trains of a frozen vocabulary matrix (the token embedding, or an untied LM head): the rows of
    `tokens` (tokens the model never saw: a parameter of their own, written over the frozen rows) and, with a
    `rank`, a LoRA update (alpha / r)·B·A of the whole matrix (B: vocab x r, at zero; A: r x d_model), as
    LoRALinear's. The optimizer keeps state for those alone."""

    def __init__(self, base: nn.Embedding | nn.Linear, tokens: Sequence[int] = (), rank: int = 0,
                 alpha: float = 0.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        held = base.weight
        self.register_buffer("tokens", torch.tensor(sorted(set(tokens)), dtype=torch.long, device=held.device))
        self.trained = nn.Parameter(held.detach()[self.tokens].clone()) if len(self.tokens) else None
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank if rank else 0.0
        if rank:
            self.lora_a = nn.Parameter(torch.empty(rank, held.size(1), device=held.device, dtype=held.dtype))
            self.lora_b = nn.Parameter(torch.zeros(held.size(0), rank, device=held.device, dtype=held.dtype))
            nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    def rows(self) -> torch.Tensor:
        """The frozen matrix with the trained rows written in."""
        if self.trained is None:
            return self.base.weight
        return self.base.weight.index_copy(0, self.tokens, self.trained)

    @property
    def weight(self) -> torch.Tensor:
        """The effective matrix, for what reads it whole (a tied head, the chunked loss)."""
        return self.rows() + self.scaling * (self.lora_b @ self.lora_a) if self.rank else self.rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.base, nn.Embedding):
            out = F.embedding(x, self.rows())
            return out + self.scaling * F.embedding(x, self.lora_b) @ self.lora_a if self.rank else out
        return self.head(x, self.base.bias)

    def head(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x times the matrix's transpose: the logits, the update applied without forming it."""
        out = F.linear(x, self.rows(), bias)
        return out + self.scaling * F.linear(F.linear(x, self.lora_a), self.lora_b) if self.rank else out

    def merged(self) -> nn.Embedding | nn.Linear:
        """The frozen module with the trained rows and the update written in (in place: a weight tied to it
        follows)."""
        with torch.no_grad():
            if self.trained is not None:
                self.base.weight.index_copy_(0, self.tokens, self.trained)
            if self.rank:
                self.base.weight.add_(self.scaling * (self.lora_b @ self.lora_a))
        return self.base

    def extra_repr(self) -> str:
        return f"tokens={self.tokens.tolist()}, rank={self.rank}, alpha={self.alpha}"


class TiedHead(nn.Module):
    """The LM head of a model whose head is its embedding (GPT-2's tied weights), over that embedding's
    `EmbeddingAdapter`: what trains of the matrix is one set of parameters for both."""

    def __init__(self, base: nn.Linear, embedding: EmbeddingAdapter) -> None:
        super().__init__()
        self.base, self.embedding = base, embedding

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding.head(x, self.base.bias)

    def merged(self) -> nn.Linear:
        return self.base  # its weight is the embedding's, merged with it


def add_lora(model: nn.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: Iterable[str] = BLOCK_PROJECTIONS, train_tokens: Iterable[int] = ()) -> nn.Module:
    """Freeze every parameter of `model` and wrap the Linear layers named by `targets` (a name's last parts:
    "attn.qkv" adapts every block's fused Q, K, V projection) in `LoRALinear`. The target "tok_emb" (or "lm_head")
    gives the vocabulary matrix a LoRA update too (`EmbeddingAdapter`; one update for both when the head is tied);
    with `train_tokens`, that matrix's rows of those token ids train whole. In place; returns the model."""
    targets = tuple(targets)
    refuse_a_second_adapter(model)
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    matrices = tuple(t for t in targets if t in VOCABULARY_MATRICES)
    blocks = tuple(t for t in targets if t not in VOCABULARY_MATRICES)
    layers = linear_layers(model)
    chosen = [name for name in layers if any(name == t or name.endswith("." + t) for t in blocks)]
    if blocks and not chosen:
        raise ValueError(f"no Linear layer of the model is named ...{', ...'.join(blocks)}; its layers end with "
                         f"{', '.join(sorted({n.split('.', 2)[-1] for n in layers}))}, or adapt "
                         f"{' or '.join(VOCABULARY_MATRICES)}")
    wrap(model, chosen, rank, alpha, dropout)
    return adapt_vocabulary(model, train_tokens, matrices, rank, alpha)


def adapt_vocabulary(model: nn.Module, tokens: Iterable[int], matrices: Sequence[str] = (), rank: int = 0,
                     alpha: float = 0.0) -> nn.Module:
    """Let the embedding and LM-head rows of `tokens` train, and give the `matrices` ("tok_emb", "lm_head") a LoRA
    update (a GPT's `tok_emb` and `lm_head`: one matrix when tied). The matrix itself is frozen; the rest of the model
    is left as it is, so on its own this is full fine-tuning with the vocabulary matrix frozen."""
    tokens = sorted(set(tokens))
    vocab = model.tok_emb.num_embeddings
    if tokens and (tokens[0] < 0 or tokens[-1] >= vocab):
        raise ValueError(f"train_tokens must be token ids of the model's vocabulary, 0 to {vocab - 1}; got {tokens}")
    if model.lm_head.weight is model.tok_emb.weight:  # tied: one matrix
        if tokens or matrices:
            model.tok_emb = EmbeddingAdapter(model.tok_emb, tokens, rank if matrices else 0, alpha)
            model.lm_head = TiedHead(model.lm_head, model.tok_emb)
        return model
    for name in VOCABULARY_MATRICES:
        if tokens or name in matrices:
            setattr(model, name, EmbeddingAdapter(getattr(model, name), tokens, rank if name in matrices else 0, alpha))
    return model


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if isinstance(module, (nn.Linear, Int8Linear))}


def refuse_a_second_adapter(model: nn.Module) -> None:
    if lora_layers(model) or vocabulary_adapters(model):
        raise ValueError("the model already has LoRA layers: merge them (merge_lora) before adding others")


def wrap(model: nn.Module, names: list[str], rank: int, alpha: float, dropout: float) -> nn.Module:
    model.requires_grad_(False)
    for name in names:
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, LoRALinear(model.get_submodule(name), rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def vocabulary_adapters(model: nn.Module) -> dict[str, EmbeddingAdapter | TiedHead]:
    return {name: module for name, module in model.named_modules()  # a tied head's embedding once, as tok_emb
            if isinstance(module, (EmbeddingAdapter, TiedHead))}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its layer (a plain Linear again), and the trained token rows and the vocabulary
    matrix's update into that matrix, and make every parameter of the model trainable, as a plain GPT trains. In
    place; returns the model."""
    for name, layer in (lora_layers(model) | vocabulary_adapters(model)).items():
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, layer.merged())
    return model.requires_grad_(True)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' A and B of every LoRA layer and of the vocabulary matrix, and the trained token rows, by
    parameter name: what fine-tuning changed."""
    layers = lora_layers(model) | {name: layer for name, layer in vocabulary_adapters(model).items()
                                   if isinstance(layer, EmbeddingAdapter)}
    return {f"{name}.{p}": getattr(layer, p).detach() for name, layer in layers.items()
            for p in ("lora_a", "lora_b", "trained") if getattr(layer, p, None) is not None}


def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write the adapters (not the model) to a safetensors file, with the rank, alpha and layers that made them;
    replaced atomically."""
    matrices = {name: m for name, m in vocabulary_adapters(model).items() if isinstance(m, EmbeddingAdapter)}
    adapted = lora_layers(model) | {name: m for name, m in matrices.items() if m.rank}
    if not adapted:
        raise ValueError("the model has no LoRA layers to save; call add_lora first")
    first = next(iter(adapted.values()))
    tokens = next(iter(matrices.values())).tokens.tolist() if matrices else []
    settings = {"rank": first.rank, "alpha": first.alpha, "targets": sorted(adapted), "train_tokens": tokens}
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
    layers, rank = linear_layers(model), settings["rank"]
    matrices = [name for name in settings["targets"] if name in VOCABULARY_MATRICES]
    blocks = [name for name in settings["targets"] if name not in VOCABULARY_MATRICES]
    expected = {}
    for name in blocks:
        if name not in layers:
            raise ValueError(f"{path} adapts a layer this model lacks, {name!r}: it was trained on another model")
        expected |= {f"{name}.lora_a": (rank, layers[name].in_features),
                     f"{name}.lora_b": (layers[name].out_features, rank)}
    vocab, width = model.tok_emb.weight.shape
    for name in matrices:
        expected |= {f"{name}.lora_a": (rank, width), f"{name}.lora_b": (vocab, rank)}
    tokens = settings.get("train_tokens", [])
    if tokens:
        tied = model.lm_head.weight is model.tok_emb.weight
        held = ("tok_emb",) if tied else VOCABULARY_MATRICES
        expected |= {f"{name}.trained": (len(tokens), width) for name in held}
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in expected.keys() & tensors.keys() if tuple(tensors[k].shape) != expected[k])
    if missing or unexpected or wrong:
        raise ValueError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}, "
                         f"wrong shape {wrong[:3]}; load it into the base model it was trained on")
    wrap(model, blocks, rank, settings["alpha"], dropout=0.0)
    adapt_vocabulary(model, tokens, matrices, rank, settings["alpha"])
    with torch.no_grad():
        for name, value in adapter_state_dict(model).items():
            value.copy_(tensors[name])
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
