"""Safe, atomic checkpoints: loading runs no pickled code, and an interrupted save never leaves half a file.

Loading uses `torch.load(weights_only=True)` (tensors and plain containers only, no arbitrary objects)
or safetensors (a JSON header and raw bytes). Saving writes a temporary file in the same folder, fsyncs
it and renames it over the old one: a rename within a file system is atomic, so a reader sees the old
checkpoint or the new one, never a mixture. A truncated file is refused by both formats' readers, but
neither checksums the tensor bytes, so `save_checkpoint` also writes a `sha256sum`-style file beside the
checkpoint that `load_checkpoint` verifies when present.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..model.loading import without_aliases
from ..system.files import atomic_path


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: missing, truncated, corrupt, or holding objects that are unsafe to load."""


def checksum_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(obj: object, path: str | os.PathLike, checksum: bool = True) -> Path:
    """Write `obj` atomically: a `.safetensors` path takes a flat dict of tensors, any other path `torch.save`s
    tensors and plain containers (a state dict, or {"model": ..., "optimizer": ..., "step": ...}).

    With `checksum`, `<path>.sha256` is written after the checkpoint (the old one is removed first, so a crash
    in between leaves no checksum rather than a wrong one).
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        if path.suffix == ".safetensors":
            if not isinstance(obj, Mapping) or not all(isinstance(t, torch.Tensor) for t in obj.values()):
                raise TypeError(f"{path.name}: safetensors stores a flat dict of tensors; save other state as .pt")
            tensors, aliases = without_aliases(obj)
            save_file({k: t.contiguous() for k, t in tensors.items()}, tmp,
                      metadata={"aliases": json.dumps(aliases)} if aliases else None)
        else:
            torch.save(obj, tmp)
        digest = sha256_file(tmp) if checksum else None
        checksum_path(path).unlink(missing_ok=True)
    if digest is not None:
        with atomic_path(checksum_path(path)) as tmp:
            tmp.write_text(f"{digest}  {path.name}\n")
    return path


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Compare the file with its `.sha256` file; raise `CheckpointError` when they differ (one read of the file)."""
    path, sums = Path(path), checksum_path(path)
    if not sums.is_file():
        raise CheckpointError(f"{path} has no checksum file {sums.name}; save it with save_checkpoint, "
                              "or load it with verify=False")
    expected = sums.read_text().split()[0]
    actual = sha256_file(path)
    if actual != expected:
        raise CheckpointError(f"{path} does not match {sums.name} (sha256 {actual[:12]}..., expected "
                              f"{expected[:12]}...): the file is corrupt; re-create it or restore a copy")


def _reason(err: BaseException) -> str:
    """The informative sentence of a loader's error: the unpickler's own reason when there is one."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?: Please use|\n|$)", text)
    return found.group(1) if found else (text.strip().splitlines() or [type(err).__name__])[0]


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", mmap: bool = False,
                    verify: bool | None = None) -> object:
    """Load what `save_checkpoint` wrote, without running pickled code.

    verify: check the sha256 file first (None: when there is one). `mmap=True` maps a `.pt` file instead of
    reading it; safetensors files are always mapped on CPU.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint file at {path}; check the path, or save one with save_checkpoint")
    if verify or (verify is None and checksum_path(path).is_file()):
        verify_checkpoint(path)
    if path.suffix == ".safetensors":
        try:
            with safe_open(path, framework="pt", device=str(map_location)) as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}
                metadata = f.metadata() or {}
        except SafetensorError as err:
            raise CheckpointError(f"{path} is not a readable safetensors file ({err}): it is truncated or "
                                  "corrupt; re-create or re-download it") from err
        for alias, name in json.loads(metadata.get("aliases", "{}")).items():
            tensors[alias] = tensors[name]
        return tensors
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a PyTorch checkpoint (no zip directory at its end): it is truncated "
                              "or corrupt (an interrupted copy?); re-create or re-download it")
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: weights-only loading refused it ({_reason(err)}); it holds objects other "
                              "than tensors and plain containers, or is corrupt: re-save it as a state dict from a "
                              "source you trust") from err
    except RuntimeError as err:
        if "PytorchStreamReader" not in str(err):
            raise
        raise CheckpointError(f"{path} is damaged ({_reason(err)}); re-create or re-download it") from err
