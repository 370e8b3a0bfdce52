"""Loading weights without holding two copies: the strategies, side by side, and a benchmark of them.

The textbook load (build the model, `torch.load`, `load_state_dict`) holds two full copies of the weights
at its peak: the randomly initialised model and the loaded state dict. Each strategy removes one copy, the
other, or the cost of initialising weights that are about to be overwritten:

* the meta device builds the model without memory or initialisation (`to_empty` then allocates it empty);
* `torch.load(mmap=True)` and safetensors map the file instead of reading it, and `assign=True` makes
  the mapped tensors the model's parameters: no copy at all; pages are read when first touched;
* a per-parameter copy or one file per tensor keeps only one tensor in flight (what matters on a GPU).

`bench_load` runs each strategy in a fresh process and reports its peak RSS above the process's baseline
(peak GPU memory on CUDA) and its time, after a forward pass has touched every weight.
`python -m helpers bench-load --help` runs it from the command line.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from .checkpoint import _fsync_dir, atomic_path, save_checkpoint, without_aliases
from .config import GPTConfig
from .memory import (
    available_memory_bytes,
    peak_cuda_bytes,
    peak_rss_above_baseline,
    proc_status_bytes,
    run_in_fresh_process,
)
from .model import GPT

# The file (or folder) each checkpoint format is written to, inside the benchmark's folder.
CHECKPOINT_FILES = {"pt": "model.pt", "safetensors": "model.safetensors", "tensor-files": "tensors"}
# The one-block model each measuring process loads first (from `<folder>/warm-up/`), with the same strategy: the
# same widths, so the math library sets up its buffers for these matrix shapes (on some CPUs ~10 MB on the first
# GEMM with the LM head's shape) before the measurement, not during it.
WARM_UP_SIZES = dict(context_length=16, n_layers=1)


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


# ---- checkpoints for the benchmark ----


def save_tensor_files(state: Mapping[str, torch.Tensor], directory: str | os.PathLike) -> Path:
    """Write each tensor to `<directory>/<name>.pt` (tied names once).

    The files go to a temporary folder that replaces `directory` once complete, so an interrupted save leaves
    the previous folder as it was (replacing a folder takes two renames, though: a crash between them leaves none).
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.", suffix=".part"))
    try:
        for name, tensor in without_aliases(state)[0].items():
            with atomic_path(tmp / f"{name}.pt") as file:
                torch.save(tensor, file)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync_dir(directory.parent)
    return directory


def reference_input(config: GPTConfig, seq: int = 16, device: str | torch.device = "cpu") -> torch.Tensor:
    """A fixed batch of token ids (no RNG), the same in every process."""
    seq = min(seq, config.context_length)
    return (torch.arange(seq, device=device) * 7919 % config.vocab_size).unsqueeze(0)


def write_checkpoints(directory: str, config: dict, formats: list[str] | None = None, seed: int = 0,
                      seq: int = 16) -> dict:
    """Write a seeded random model in each format (and a one-block one for warm-up runs); return the file sizes
    and the reference logits."""
    formats = formats or list(CHECKPOINT_FILES)
    for folder, cfg in ((Path(directory) / "warm-up", GPTConfig(**{**config, **WARM_UP_SIZES})),
                        (Path(directory), GPTConfig(**config))):
        torch.manual_seed(seed)
        model = GPT(cfg).eval()
        state = model.state_dict()
        for fmt in formats:
            path = folder / CHECKPOINT_FILES[fmt]
            if fmt == "tensor-files":
                save_tensor_files(state, path)
            else:
                save_checkpoint(state, path, checksum=False)
    with torch.no_grad():
        logits = model(reference_input(cfg, seq))[0, -1, :8]
    sizes = {fmt: checkpoint_bytes(Path(directory) / CHECKPOINT_FILES[fmt]) for fmt in formats}
    return {"bytes": sizes, "logits": logits.tolist()}


def checkpoint_bytes(path: Path) -> int:
    """Size of a checkpoint file, or of all files in a checkpoint folder."""
    return sum(p.stat().st_size for p in path.iterdir()) if path.is_dir() else path.stat().st_size


def mapped_file_bytes() -> int | None:
    """Resident memory of this process that maps files (RssFile; Linux only): the touched pages of an mmapped
    checkpoint, which the kernel can drop and re-read, unlike the anonymous memory of copied tensors."""
    return proc_status_bytes("RssFile")


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget a (fsynced) file's cached pages, so the next read comes from the disk."""
    for file in path.iterdir() if path.is_dir() else [path]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- measuring one strategy, in a fresh process ----


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def touch_every_weight(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """A forward pass reads every weight matrix; the embedding tables are read only at the rows it looks up,
    so they are summed as well. Returns the logits."""
    with torch.no_grad():
        logits = model(idx)
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                module.weight.sum().item()
    return logits


def measure_strategy(strategy: str, directory: str, config: dict, device: str = "cpu", seq: int = 16) -> dict:
    """Entry point of the fresh process: load with one strategy, touch every weight, report peaks and times."""
    cfg, dev = GPTConfig(**config), torch.device(device)
    chosen = STRATEGIES[strategy]
    path = Path(directory) / CHECKPOINT_FILES[chosen.checkpoint]
    idx = reference_input(cfg, seq, dev)
    # A first run on a one-block checkpoint of the same widths: one-time library set-up (imports behind the meta
    # device, the CUDA context, kernel selection, GEMM buffers) is not counted against the strategy.
    warm_cfg = GPTConfig(**{**config, **WARM_UP_SIZES})
    warm_path = Path(directory) / "warm-up" / CHECKPOINT_FILES[chosen.checkpoint]
    touch_every_weight(chosen.load(warm_path, warm_cfg, dev).eval(), reference_input(warm_cfg, seq, dev))
    file_before = mapped_file_bytes() or 0
    out: dict = {}

    def load_and_touch() -> None:
        start = time.perf_counter()
        model = chosen.load(path, cfg, dev)
        _sync(dev)
        loaded = time.perf_counter()
        logits = touch_every_weight(model.eval(), idx)
        _sync(dev)
        out.update(seconds=loaded - start, first_forward_seconds=time.perf_counter() - loaded,
                   logits=logits[0, -1, :8].tolist(), tied=model.lm_head.weight is model.tok_emb.weight,
                   resident_file_bytes=max(0, (mapped_file_bytes() or 0) - file_before))

    if dev.type == "cuda":
        out["peak_rss_bytes"] = peak_rss_above_baseline(
            lambda: out.update(peak_cuda_bytes=peak_cuda_bytes(load_and_touch, dev)))
    else:
        out["peak_rss_bytes"] = peak_rss_above_baseline(load_and_touch)
    return out


# ---- the benchmark ----


@dataclass
class LoadBenchResult:
    strategy: str
    description: str
    status: str  # "ok", or "skipped" with the reason
    reason: str | None
    model: str
    device: str
    checkpoint_bytes: int
    peak_rss_bytes: int | None  # peak RSS above the process's baseline (CPU RAM, on any device)
    peak_cuda_bytes: int | None  # peak CUDA allocation (on a CUDA device)
    seconds: float | None  # the load: from the call to a model on the device (median over repeats)
    first_forward_seconds: float | None  # then the first forward pass plus a read of the embedding tables
    resident_file_bytes: int | None  # RSS that maps the checkpoint file (page cache), with the model loaded
    matches_reference: bool | None  # same logits as the saved model, and the LM head still tied
    cold: bool  # the checkpoint was dropped from the page cache before each run


def bench_load(model: str | GPTConfig = "gpt2-small", strategies: list[str] | None = None, device: str = "cpu",
               directory: str | os.PathLike | None = None, repeats: int = 1, cold: bool = False,
               progress: Callable[[str], None] | None = None) -> list[LoadBenchResult]:
    """Write a seeded checkpoint of `model` (a preset name or a config) in every format the strategies need, then
    run each strategy `repeats` times, each in a fresh process. Checkpoints go to `directory` (default: a
    temporary folder in the course cache, deleted afterwards: on disk, as /tmp may be RAM)."""
    from .data import cache_dir

    config = GPTConfig.from_preset(model, dropout=0.0) if isinstance(model, str) else model
    label = model if isinstance(model, str) else "custom"
    names = list(STRATEGIES) if strategies is None else strategies
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; valid: {', '.join(STRATEGIES)}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if cold and not hasattr(os, "posix_fadvise"):
        raise ValueError("cold=True drops files from the page cache with posix_fadvise, which this OS lacks; "
                         "use cold=False")
    if directory is not None:
        return _bench(config, label, names, device, Path(directory), repeats, cold, progress)
    cache_dir().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="bench-load-") as tmp:
        return _bench(config, label, names, device, Path(tmp), repeats, cold, progress)


def _bench(config: GPTConfig, label: str, names: list[str], device: str, directory: Path, repeats: int, cold: bool,
           progress: Callable[[str], None] | None) -> list[LoadBenchResult]:
    formats = list(dict.fromkeys(STRATEGIES[n].checkpoint for n in names))
    config_dict = asdict(config)
    if progress:
        progress(f"writing {', '.join(formats)} checkpoints of {label}")
    written = run_in_fresh_process("helpers.loading:write_checkpoints", directory=str(directory), config=config_dict,
                                   formats=formats)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    skipped: dict[str, str] = {}
    for _ in range(repeats):  # strategies interleaved, so a slow spell of a shared machine hits them all
        for name in names:
            chosen = STRATEGIES[name]
            size = written["bytes"][chosen.checkpoint]
            available = available_memory_bytes()
            if available is not None and chosen.copies * size * 1.1 > available:
                skipped[name] = (f"needs ~{chosen.copies * size / 2**30:.1f} GiB of RAM, "
                                 f"{available / 2**30:.1f} GiB available")
                continue
            if cold:
                drop_from_page_cache(directory / CHECKPOINT_FILES[chosen.checkpoint])
            if progress:
                progress(f"{name} ({label})")
            runs[name].append(run_in_fresh_process("helpers.loading:measure_strategy", strategy=name,
                                                   directory=str(directory), config=config_dict, device=device))
    expected = torch.tensor(written["logits"])
    results = []
    for name in names:
        rows = runs[name]
        common = dict(strategy=name, description=STRATEGIES[name].description, model=label, device=device,
                      checkpoint_bytes=written["bytes"][STRATEGIES[name].checkpoint], cold=cold)
        if not rows:
            results.append(LoadBenchResult(status="skipped", reason=skipped[name], peak_rss_bytes=None,
                                           peak_cuda_bytes=None, seconds=None, first_forward_seconds=None,
                                           resident_file_bytes=None, matches_reference=None, **common))
            continue
        cuda = [r["peak_cuda_bytes"] for r in rows if "peak_cuda_bytes" in r]
        results.append(LoadBenchResult(
            status="ok", reason=None,
            peak_rss_bytes=int(statistics.median(r["peak_rss_bytes"] for r in rows)),
            peak_cuda_bytes=int(statistics.median(cuda)) if cuda else None,
            seconds=statistics.median(r["seconds"] for r in rows),
            first_forward_seconds=statistics.median(r["first_forward_seconds"] for r in rows),
            resident_file_bytes=int(statistics.median(r["resident_file_bytes"] for r in rows)),
            matches_reference=all(r["tied"] == config.tie_weights and torch.allclose(
                torch.tensor(r["logits"]), expected, rtol=1e-4, atol=1e-5) for r in rows),
            **common,
        ))
    return results


def results_as_dicts(results: list[LoadBenchResult]) -> list[dict]:
    return [asdict(r) for r in results]


def format_results(results: list[LoadBenchResult]) -> str:
    """A text table: peak memory as a multiple of the checkpoint size, load and first-forward times."""
    cuda = any(r.peak_cuda_bytes is not None for r in results)
    header = (f"{'strategy':<17} {'peak RSS MiB':>12} {'x ckpt':>7} {'mapped MiB':>10}"
              + (f" {'peak GPU MiB':>12} {'x ckpt':>7}" if cuda else "")
              + f" {'load s':>8} {'1st fwd s':>9} {'load+fwd s':>10}  same logits")
    lines = [header]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.strategy:<17} skipped: {r.reason}")
            continue
        gpu = f" {r.peak_cuda_bytes / 2**20:12.1f} {r.peak_cuda_bytes / r.checkpoint_bytes:6.2f}x" if cuda else ""
        lines.append(f"{r.strategy:<17} {r.peak_rss_bytes / 2**20:12.1f} {r.peak_rss_bytes / r.checkpoint_bytes:6.2f}x "
                     f"{r.resident_file_bytes / 2**20:10.1f}{gpu} {r.seconds:8.3f} {r.first_forward_seconds:9.3f} "
                     f"{r.seconds + r.first_forward_seconds:10.3f}  {'yes' if r.matches_reference else 'NO'}")
    return "\n".join(lines)
