"""Inside a torchrun script: joining the process group, the scripts' shared command line, comparing with the
single-process model, and writing results."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ..model.config import PRESETS, GPTConfig
from ..model.feed_forward import FEED_FORWARDS
from ..model.norm import NORMS
from ..model.position_encoding import POSITION_ENCODINGS
from ..system.args import positive_float, positive_int
from ..system.files import atomic_path


@dataclass(frozen=True)
class Runtime:
    """What a rank knows about the run it is part of."""

    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device_type(requested: str, local_world_size: int, cuda_count: int) -> str:
    """"cuda" when every local rank gets its own GPU (NCCL cannot put two ranks on one GPU), else "cpu".

    `requested` "auto" decides by the GPUs present; "cuda" with too few GPUs is an error, not a quiet switch.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and cuda_count < local_world_size:
        raise RuntimeError(f"--device cuda needs one GPU per process: {local_world_size} processes, {cuda_count} "
                           "GPU(s); launch fewer processes (--nproc-per-node) or use --device cpu (gloo)")
    if requested == "auto":
        return "cuda" if cuda_count >= local_world_size else "cpu"
    return requested


def setup(device: str = "auto", timeout_s: float = 120) -> Runtime:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    A collective that waits longer than `timeout_s` raises in the rank instead of blocking forever.
    """
    if hasattr(signal, "SIGUSR1"):  # `launch` sends it to a run that timed out: print where this rank waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "RANK" not in os.environ:
        raise RuntimeError("this script runs under torchrun: python -m torch.distributed.run --standalone "
                           "--nproc-per-node 2 SCRIPT ... (or helpers.parallel.launch.launch from Python)")
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_type = pick_device_type(device, local_world, cuda_count)
    if device == "auto" and device_type == "cpu" and cuda_count and local_rank == 0:
        print(f"{local_world} processes but {cuda_count} GPU(s): running on CPU with gloo (--device cpu to silence "
              "this; launch one process per GPU to use NCCL)", flush=True)
    if device_type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons with the single-process model
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return Runtime(dist.get_rank(), dist.get_world_size(), dev, dist.get_backend())


def finish_and_exit() -> NoReturn:
    """The last call of a script's `main`: wait for every rank, leave the process group, and end this process at
    once (`os._exit`, after flushing its output), not through the interpreter's shutdown. Everything the run
    produces is written by then; what is left is freeing objects, and freeing FSDP's and gloo's after the group
    is gone can deadlock: one rank of fsdp.py finished its work, passed the barrier and then never exited."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of every rank's `value` (e.g. each rank's error on its own shard)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double().to(a.device)).abs().max().item()


def max_param_diff(model: nn.Module, reference: nn.Module) -> float:
    """Largest |difference| between same-named parameters of two copies of a model (plain tensors)."""
    ref = dict(reference.named_parameters())
    return max(max_abs_diff(p, ref[name]) for name, p in model.named_parameters())


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Model size (a preset with fields overridden), device, seed, collective timeout, output JSON."""
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes its results to")
    parser.add_argument("--model", choices=list(PRESETS), default="gpt-smoke",
                        help="preset the model starts from (default: gpt-smoke)")
    parser.add_argument("--layers", type=positive_int, help="n_layers (default: the preset's)")
    parser.add_argument("--d-model", type=positive_int, help="d_model (default: the preset's)")
    parser.add_argument("--heads", type=positive_int, help="n_heads (default: the preset's)")
    parser.add_argument("--ctx", type=positive_int, help="context_length (default: the preset's)")
    parser.add_argument("--vocab", type=positive_int,
                        help="vocab_size; token ids are taken modulo it (default: the preset's)")
    parser.add_argument("--ffn", choices=list(FEED_FORWARDS), help="feed-forward type (default: the preset's)")
    parser.add_argument("--norm", choices=list(NORMS), help="norm (default: the preset's)")
    parser.add_argument("--position-encoding", choices=list(POSITION_ENCODINGS),
                        help="position encoding (default: the preset's)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: one GPU per process when there are enough, else CPU with gloo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=positive_float, default=120,
                        help="seconds a collective may wait before it fails")


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """--dtype of the weights, for the scripts that compare optimizer steps with one process."""
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float64 makes the comparison with one process exact: Adam divides by sqrt(v), so in "
                             "float32 a rounding difference in a near-zero gradient can change an update completely")


def config_from_args(args: argparse.Namespace) -> GPTConfig:
    """The preset with the command line's overrides; dropout off, so every variant computes the same function."""
    overrides = {"n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
                 "context_length": args.ctx, "vocab_size": args.vocab, "ffn_type": args.ffn, "norm": args.norm,
                 "position_encoding": args.position_encoding}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return GPTConfig.from_preset(args.model, dropout=0.0, **overrides)


def config_from_flags(flags: Sequence[str]) -> GPTConfig:
    """The GPTConfig a chapter script builds from these model flags (`--model`, `--layers`, `--ffn`, ...), read by
    the scripts' own parser: what a notebook passes to a script, as the script reads it."""
    parser = argparse.ArgumentParser(prog="model flags")
    add_common_args(parser)
    return config_from_args(parser.parse_args(["--out", "unused.json", *map(str, flags)]))


def rank_batches(dataset: Dataset, world_size: int, rank: int, batch: int, seed: int, n_batches: int) -> list:
    """The first `n_batches` batches rank `rank` reads: a DistributedSampler gives it every world_size-th window
    of a seeded shuffle. Rank 0 calls this for every rank to rebuild the concatenated batches of the reference."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(0)
    batches = []
    for xy in DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True):
        if len(batches) == n_batches:
            break
        batches.append(xy)
    if len(batches) < n_batches:
        raise ValueError(f"the corpus gives each rank only {len(batches)} batches of {batch}; "
                         "use fewer steps, fewer micro-batches or a smaller batch")
    return batches


def token_ids(vocab_size: int) -> torch.Tensor:
    """The course corpus as GPT-2 ids, folded into a smaller vocabulary (id mod vocab_size) for tiny models."""
    from ..text.data import load_token_ids

    return load_token_ids() % vocab_size


def run_info(runtime: Runtime, config: GPTConfig, **fields) -> dict:
    """The header every script's JSON starts with: who ran what, where."""
    device_name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu"
    return {"world_size": runtime.world_size, "backend": runtime.backend, "device": device_name,
            "torch": torch.__version__, "config": dataclasses.asdict(config), **fields}


def write_json(runtime: Runtime, path: Path, results: dict) -> None:
    """Rank 0 writes the results (atomically, so a reader never sees half a file)."""
    if not runtime.is_main:
        return
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(results, indent=2))
