"""What the Hugging Face layouts share (`hf_gpt2`, `hf_llama`): their error, and writing weights with their config.

An export writes two files, each replaced atomically but not the pair; the weights carry a copy of their config.json
in the safetensors metadata, so a load can refuse a pair from two different exports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..system.files import atomic_path

EXPORTED_CONFIG = "helpers.config_json"  # safetensors metadata key: the config.json written with these weights


class WeightsError(ValueError):
    """A file's tensors or config do not fit the model: which tensor, expected against found, and what to do."""


def check_exported_config(metadata: Mapping[str, str] | None, hf_config: Mapping | None, source: object) -> None:
    """Refuse a config.json other than the one the weights were exported with (a copy sits in their metadata)."""
    exported = json.loads((metadata or {}).get(EXPORTED_CONFIG, "{}"))
    differ = sorted(k for k, v in exported.items() if hf_config is not None and hf_config.get(k) != v)
    if differ:
        raise WeightsError(f"{source} is not the config these weights were exported with ({', '.join(differ)} "
                           "differ): an export into this folder was interrupted or the files come from different "
                           "models; export the model again")


def save_with_config(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], config: dict) -> Path:
    """`model.safetensors` (with a copy of `config` in its metadata, for `check_exported_config`) and `config.json`
    in `directory`, each replaced atomically."""
    directory = Path(directory)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file({k: t.cpu() for k, t in tensors.items()}, tmp,
                  metadata={"format": "pt", EXPORTED_CONFIG: json.dumps(config, sort_keys=True)})
    with atomic_path(directory / "config.json") as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
    return directory
