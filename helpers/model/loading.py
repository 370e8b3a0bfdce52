"""Loading a GPT's weights without holding two copies: the strategies, each a function (path, config, device) -> GPT.

The textbook load (build the model, `torch.load`, `load_state_dict`) holds two full copies of the weights
at its peak: the randomly initialised model and the loaded state dict. Each strategy removes one copy, the
other, or the cost of initialising weights that are about to be overwritten:

* the meta device builds the model without memory or initialisation (`to_empty` then allocates it empty);
* `torch.load(mmap=True)` and safetensors map the file instead of reading it, and `assign=True` makes
  the mapped tensors the model's parameters: no copy at all; pages are read when first touched;
* a per-parameter copy or one file per tensor keeps only one tensor in flight (what matters on a GPU).

Every strategy refuses a checkpoint of another configuration, naming the tensors (`StateMismatch`).
`helpers.measure.load_bench` measures them side by side.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..system.files import atomic_directory
from .config import GPTConfig
from .gpt import GPT

# The file (or folder) each checkpoint format is written to, inside the benchmark's folder.
CHECKPOINT_FILES = {"pt": "model.pt", "safetensors": "model.safetensors", "tensor-files": "tensors"}


def tie_weights(model: GPT) -> GPT:
    """Share the LM head with the token embedding again, as GPT-2 does.

    `load_state_dict(assign=True)` and `to_empty` give every name its own Parameter, so a tied pair
    becomes two parameters (that an optimizer would update separately) even when they view the same memory.
    """
    if model.config.tie_weights:
        model.lm_head.weight = model.tok_emb.weight
    return model


class StateMismatch(ValueError):
    """A checkpoint's tensors do not fit the model: which names are missing or unexpected, which shapes differ."""


def check_names(model: GPT, names: Iterable[str], source: object) -> None:
    """Refuse a checkpoint written for another configuration, naming its missing and unexpected tensors.

    Loading one tensor at a time (`strict=False`) would otherwise skip extra layers without a word. A tied LM
    head may be absent (files that store shared tensors once).
    """
    expected, found = set(model.state_dict()), set(names)
    optional = {"lm_head.weight"} if model.config.tie_weights else set()
    missing, unexpected = sorted(expected - found - optional), sorted(found - expected)
    if missing or unexpected:
        parts = [f"{len(names)} {kind} tensor(s) ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
                 for kind, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise StateMismatch(f"{source} does not fit this GPTConfig: {' and '.join(parts)}; it was written for "
                            "another configuration: build the model with the checkpoint's config")


def check_state(model: GPT, shapes: Mapping[str, tuple[int, ...]], source: object) -> None:
    """`check_names`, then every shape: a copy into a parameter of another width would fail with a broadcasting
    error that names no tensor."""
    check_names(model, shapes, source)
    expected = model.state_dict()
    for name, shape in shapes.items():
        if tuple(shape) != tuple(expected[name].shape):
            raise StateMismatch(f"{source}: tensor {name!r} has shape {tuple(shape)}, the model expects "
                                f"{tuple(expected[name].shape)}; it was written for another configuration: build "
                                "the model with the checkpoint's config")


def shapes_of(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in state.items()}


def assign_state_dict(model: GPT, state: Mapping[str, torch.Tensor]) -> GPT:
    """Make the tensors in `state` the model's parameters (no copy), then tie the LM head again."""
    state = dict(state)
    if model.config.tie_weights:  # files that store tied weights once (safetensors) lack the LM head
        state.setdefault("lm_head.weight", state["tok_emb.weight"])
    model.load_state_dict(state, assign=True)
    return tie_weights(model)


# ---- the strategies: (checkpoint path, config, device) -> GPT with the checkpoint's weights ----


def load_baseline(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """Build (and randomly initialise) the model, read the whole file, copy it in: two copies at the peak."""
    model = GPT(config)
    state = torch.load(path, weights_only=True)
    check_state(model, shapes_of(state), path)
    model.load_state_dict(state)
    return model.to(device)


def load_map_location(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """Build the model on the device and load the tensors straight there: two copies, both on the device."""
    with torch.device(device):
        model = GPT(config)
    state = torch.load(path, map_location=device, weights_only=True)
    check_state(model, shapes_of(state), path)
    model.load_state_dict(state)
    return model


def load_sequential(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """Copy one parameter at a time from a CPU state dict, freeing each after its copy.

    On a GPU the device holds one copy (the model) and the CPU the other; on a CPU both are in RAM.
    """
    with torch.device(device):
        model = GPT(config)
    state = torch.load(path, map_location="cpu", weights_only=True)
    check_state(model, shapes_of(state), path)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied weight is listed (and copied) once
            param.copy_(state.pop(name))
    return model


def load_meta_to_empty(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """Build on the meta device (no memory, no random init), allocate empty, copy the loaded tensors in."""
    with torch.device("meta"):
        model = GPT(config)
    tie_weights(model.to_empty(device=device))
    state = torch.load(path, weights_only=True)
    check_state(model, shapes_of(state), path)
    model.load_state_dict(state)
    return model


def load_mmap_assign(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """Map the file (no read), and make the mapped tensors the parameters: no copy at all on CPU."""
    with torch.device("meta"):
        model = GPT(config)
    state = torch.load(path, mmap=True, weights_only=True, map_location=device)
    check_state(model, shapes_of(state), path)
    return assign_state_dict(model, state)


def load_safetensors_file(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """safetensors' `load_file`: every tensor at once, mapped from the file on CPU."""
    with torch.device("meta"):
        model = GPT(config)
    state = load_file(path, device=str(device))
    check_state(model, shapes_of(state), path)
    return assign_state_dict(model, state)


def load_safetensors_lazy(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """safetensors' `safe_open`: read the header, then fetch one tensor at a time, by name."""
    with torch.device("meta"):
        model = GPT(config)
    with safe_open(path, framework="pt", device=str(device)) as f:
        check_state(model, {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}, path)
        for name in f.keys():
            model.load_state_dict({name: f.get_tensor(name)}, strict=False, assign=True)
    return tie_weights(model)


def load_tensor_files(path: Path, config: GPTConfig, device: torch.device) -> GPT:
    """One file per tensor: load and assign them one by one, so at most one tensor is in flight."""
    with torch.device("meta"):
        model = GPT(config)
    files = sorted(path.glob("*.pt"))
    check_names(model, [file.stem for file in files], path)  # load_state_dict names a tensor of another shape
    for file in files:
        tensor = torch.load(file, map_location=device, weights_only=True)
        model.load_state_dict({file.stem: tensor}, strict=False, assign=True)
    return tie_weights(model)


@dataclass(frozen=True)
class Strategy:
    name: str
    description: str
    checkpoint: str  # the format it reads: a key of CHECKPOINT_FILES
    copies: int  # full copies of the weights in CPU RAM at the peak on a CPU (for the memory check)
    load: Callable[[Path, GPTConfig, torch.device], GPT]


STRATEGIES = {s.name: s for s in (
    Strategy("baseline", "GPT(config), torch.load, load_state_dict", "pt", 2, load_baseline),
    Strategy("map_location", "build on the device, torch.load(map_location=device)", "pt", 2, load_map_location),
    Strategy("sequential", "copy parameter by parameter, freeing each", "pt", 2, load_sequential),
    Strategy("meta_to_empty", "meta device, to_empty, load_state_dict", "pt", 2, load_meta_to_empty),
    Strategy("mmap_assign", "meta device, torch.load(mmap=True), load_state_dict(assign=True)", "pt", 1,
             load_mmap_assign),
    Strategy("safetensors_file", "meta device, safetensors load_file, assign", "safetensors", 1,
             load_safetensors_file),
    Strategy("safetensors_lazy", "meta device, safetensors safe_open, one tensor at a time", "safetensors", 1,
             load_safetensors_lazy),
    Strategy("tensor_files", "meta device, one torch.save file per tensor, assigned one by one", "tensor-files", 1,
             load_tensor_files),
)}


def without_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop names that view the same memory as an earlier name (tied weights); return {alias: kept name}.

    safetensors stores each tensor's bytes once and refuses shared memory, so a tied LM head is saved
    as a reference to the embedding, as Hugging Face does.
    """
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape,
               tensor.stride(), tensor.dtype)
        if key in seen and tensor.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = tensor
    return kept, aliases


def save_tensor_files(state: Mapping[str, torch.Tensor], directory: str | os.PathLike) -> Path:
    """Write each tensor to `<directory>/<name>.pt` (tied names once).

    The files go to a temporary folder that replaces `directory` once complete, so an interrupted save leaves
    the previous folder as it was (replacing a folder takes two renames, though: a crash between them leaves none).
    """
    with atomic_directory(directory) as tmp:
        for name, tensor in without_aliases(state)[0].items():
            torch.save(tensor, tmp / f"{name}.pt")
    return Path(directory)
