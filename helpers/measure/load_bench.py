"""The loading benchmark: each strategy of `helpers.model.loading` in a fresh process, side by side.

`bench_load` writes a seeded random model in each checkpoint format, then runs each strategy in a fresh process
and reports its peak RSS above the process's baseline (peak GPU memory on CUDA) and its time, after a forward
pass has touched every weight. `python -m helpers bench-load --help` runs it from the command line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..model.config import PRESETS, GPTConfig
from ..model.gpt import GPT
from ..model.loading import CHECKPOINT_FILES, STRATEGIES, save_tensor_files
from ..system.args import positive_int
from ..system.cli import Command, add_device, add_json
from ..system.device import synchronize
from ..training.checkpoint import save_checkpoint
from .memory import (
    available_memory_bytes,
    peak_cuda_bytes,
    peak_rss_above_baseline,
    proc_status_bytes,
    run_in_fresh_process,
)
from .timing import Spread

# The one-block model each measuring process loads first (from `<folder>/warm-up/`), with the same strategy: the
# same widths, so the math library sets up its buffers for these matrix shapes (on some CPUs ~10 MB on the first
# GEMM with the LM head's shape) before the measurement, not during it.
WARM_UP_SIZES = dict(context_length=16, n_layers=1)


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
        synchronize(dev)
        loaded = time.perf_counter()
        logits = touch_every_weight(model.eval(), idx)
        synchronize(dev)
        out.update(seconds=loaded - start, first_forward_seconds=time.perf_counter() - loaded,
                   logits=logits[0, -1, :8].tolist(), tied=model.lm_head.weight is model.tok_emb.weight,
                   resident_file_bytes=max(0, (mapped_file_bytes() or 0) - file_before))

    if dev.type == "cuda":
        out["peak_rss_bytes"] = peak_rss_above_baseline(
            lambda: out.update(peak_cuda_bytes=peak_cuda_bytes(load_and_touch, dev)))
    else:
        out["peak_rss_bytes"] = peak_rss_above_baseline(load_and_touch)
    return out


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
    seconds_runs: list[float] | None  # the load time of each repeat (its spread: `load_seconds`)
    first_forward_seconds_runs: list[float] | None
    resident_file_bytes: int | None  # RSS that maps the checkpoint file (page cache), with the model loaded
    matches_reference: bool | None  # same logits as the saved model, and the LM head still tied
    cold: bool  # the checkpoint was dropped from the page cache before each run


def bench_load(model: str | GPTConfig = "gpt2-small", strategies: list[str] | None = None, device: str = "cpu",
               directory: str | os.PathLike | None = None, repeats: int = 1, cold: bool = False,
               progress: Callable[[str], None] | None = None) -> list[LoadBenchResult]:
    """Write a seeded checkpoint of `model` (a preset name or a config) in every format the strategies need, then
    run each strategy `repeats` times, each in a fresh process. Checkpoints go to `directory` (default: a
    temporary folder in the course cache, deleted afterwards: on disk, as /tmp may be RAM)."""
    from ..system.files import cache_dir

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
    written = run_in_fresh_process("helpers.measure.load_bench:write_checkpoints", directory=str(directory),
                                   config=config_dict, formats=formats)
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
            runs[name].append(run_in_fresh_process("helpers.measure.load_bench:measure_strategy", strategy=name,
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
                                           seconds_runs=None, first_forward_seconds_runs=None,
                                           resident_file_bytes=None, matches_reference=None, **common))
            continue
        cuda = [r["peak_cuda_bytes"] for r in rows if "peak_cuda_bytes" in r]
        results.append(LoadBenchResult(
            status="ok", reason=None,
            peak_rss_bytes=int(statistics.median(r["peak_rss_bytes"] for r in rows)),
            peak_cuda_bytes=int(statistics.median(cuda)) if cuda else None,
            seconds=statistics.median(r["seconds"] for r in rows),
            first_forward_seconds=statistics.median(r["first_forward_seconds"] for r in rows),
            seconds_runs=[r["seconds"] for r in rows],
            first_forward_seconds_runs=[r["first_forward_seconds"] for r in rows],
            resident_file_bytes=int(statistics.median(r["resident_file_bytes"] for r in rows)),
            matches_reference=all(r["tied"] == config.tie_weights and torch.allclose(
                torch.tensor(r["logits"]), expected, rtol=1e-4, atol=1e-5) for r in rows),
            **common,
        ))
    return results


def load_seconds(result: LoadBenchResult) -> Spread:
    """A strategy's load time over its repeats, to compare strategies by `helpers.measure.timing.verdict`."""
    if result.status != "ok":
        raise ValueError(f"{result.strategy} did not run ({result.reason}); only measured strategies have times")
    return Spread(tuple(result.seconds_runs))


def results_as_dicts(results: list[LoadBenchResult]) -> list[dict]:
    return [asdict(r) for r in results]


def format_results(results: list[LoadBenchResult]) -> str:
    """A text table: peak memory as a multiple of the checkpoint size, load and first-forward times."""
    cuda = any(r.peak_cuda_bytes is not None for r in results)
    header = (f"{'strategy':<17} {'peak RSS MiB':>12} {'x ckpt':>7} {'mapped MiB':>10}"
              + (f" {'peak GPU MiB':>12} {'x ckpt':>7}" if cuda else "")
              + f" {'load s':>8} {'IQR':>13} {'1st fwd s':>9} {'load+fwd s':>10}  same logits")
    lines = [header]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.strategy:<17} skipped: {r.reason}")
            continue
        gpu = f" {r.peak_cuda_bytes / 2**20:12.1f} {r.peak_cuda_bytes / r.checkpoint_bytes:6.2f}x" if cuda else ""
        iqr = "{:.3f}–{:.3f}".format(*load_seconds(r).quartiles)
        lines.append(f"{r.strategy:<17} {r.peak_rss_bytes / 2**20:12.1f} {r.peak_rss_bytes / r.checkpoint_bytes:6.2f}x "
                     f"{r.resident_file_bytes / 2**20:10.1f}{gpu} {r.seconds:8.3f} {iqr:>13} "
                     f"{r.first_forward_seconds:9.3f} {r.seconds + r.first_forward_seconds:10.3f}  "
                     f"{'yes' if r.matches_reference else 'NO'}")
    return "\n".join(lines)


def _arguments(parser) -> None:
    parser.add_argument("--model", choices=list(PRESETS), default="gpt2-small",
                        help="preset whose size the random checkpoint has (default: gpt2-small)")
    parser.add_argument("--only", nargs="+", choices=list(STRATEGIES), metavar="NAME",
                        help=f"strategies to run (default: all of {', '.join(STRATEGIES)})")
    add_device(parser)
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="fresh-process runs per strategy, interleaved; median and IQR (default: 3)")
    parser.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before each run")
    add_json(parser, "a table", "a JSON list")


def _run(args) -> int:
    from ..system.device import default_device_type

    results = bench_load(args.model, args.only, device=args.device or default_device_type(), repeats=args.repeats,
                         cold=args.cold, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(results_as_dicts(results), indent=2) if args.json else format_results(results))
    return 0


COMMAND = Command("bench-load", "peak memory and time of each weight-loading strategy", _arguments, _run)
