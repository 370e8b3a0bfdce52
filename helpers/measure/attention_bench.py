"""Benchmark every attention implementation on the same weights: median time with its interquartile range
(the implementations timed interleaved), peak memory, and which SDPA backend PyTorch dispatched to (and why
FlashAttention was or was not chosen).

`python -m helpers bench-attention --help` runs it from the command line.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from ..model.attention import (
    IMPLEMENTATIONS,
    AttentionCall,
    CausalSelfAttention,
    fused_kernel_shares_kv_heads,
    repeat_kv,
    unavailable_reason,
)
from ..model.config import GPTConfig
from ..system.args import positive_float
from ..system.cli import Command, add_device, add_json, add_scaled, fill_scale_defaults
from ..system.device import DTYPES, parse_dtype
from .memory import peak_cuda_bytes, peak_rss_above_baseline, run_in_fresh_process
from .timing import Spread, interleaved

MODES = ("fwd", "fwdbwd", "compiled")  # compiled = forward of torch.compile(module)


@dataclass
class AttentionBenchResult:
    name: str
    description: str
    status: str  # "ok", "skipped" (cannot run here, with the reason) or "error"
    reason: str | None
    median_ms: float | None
    peak_mem_bytes: int | None
    ratio_vs_sdpa: float | None  # median time / SDPA's median time: 2.0 = twice as slow
    mode: str
    batch: int
    seq: int
    d_model: int
    heads: int
    dtype: str
    device: str
    iqr_ms: tuple[float, float] | None = None  # first and third quartile of the timed runs
    differs_from_sdpa: bool | None = None  # False: the IQRs overlap SDPA's, no measurable difference


def _skip_reason(name: str, mode: str, device: torch.device, dtype: torch.dtype, d_model: int) -> str | None:
    reason = unavailable_reason(name, AttentionCall(device, dtype, backward=mode == "fwdbwd"))
    if reason is None and mode == "compiled" and name == "flash_torch":
        reason = "not compiled: its Python loop over tiles would unroll into thousands of graph nodes"
    return reason


def make_step(name: str, batch: int, seq: int, d_model: int, heads: int, dtype: torch.dtype,
              device: torch.device, mode: str, seed: int = 0, backend: str | Callable = "inductor"):
    """A module with seeded weights and a zero-argument function running one measured step.

    Mode "compiled" compiles with `backend` (torch.compile's default; tests pass one that counts graphs) after
    `torch.compiler.reset()`, which drops every compiled graph in the process. Without it the implementations
    (and shapes) compiled before pile up on the one `CausalSelfAttention.forward`, and past dynamo's recompile
    limit (8) the rest run eagerly without an error; a second shape would also compile a dynamic-shape graph.
    """
    torch.manual_seed(seed)
    module = CausalSelfAttention(d_model, heads, attn_implementation=name).to(device=device, dtype=dtype)
    x = torch.randn(batch, seq, d_model, device=device, dtype=dtype, requires_grad=mode == "fwdbwd")
    if mode == "fwdbwd":
        grad = torch.randn_like(x)

        def step():
            module(x).backward(grad)
    else:
        run = module
        if mode == "compiled":
            torch.compiler.reset()
            run = torch.compile(module, backend=backend)

        def step():
            with torch.no_grad():
                return run(x)
    return module, step


def peak_memory_in_fresh_process(**setting) -> int:
    """Entry point of the fresh process that measures one implementation's peak RSS."""
    setting["dtype"], setting["device"] = DTYPES[setting["dtype"]], torch.device(setting["device"])
    _, step = make_step(**setting)
    step()  # warm-up: one-time buffers (and compilation) are not the step's memory
    return peak_rss_above_baseline(step)


def bench_attention(batch: int, seq: int, d_model: int, heads: int, dtype: str = "float32", device: str = "cpu",
                    mode: str = "fwd", names: list[str] | None = None, min_run_time: float = 0.5,
                    memory: bool = True, rounds: int = 7) -> list[AttentionBenchResult]:
    """Time (and measure the peak memory of) each implementation with the same weights and input.

    The implementations run interleaved, `rounds` times each (about `min_run_time` seconds per implementation),
    so a busy moment of the machine falls on all of them alike. Compiled ones are timed one after another:
    compiling one resets the compiled code of the others.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    torch_dtype, dev = parse_dtype(dtype), torch.device(device)
    names = list(IMPLEMENTATIONS) if names is None else names
    common = {name: dict(name=name, description=IMPLEMENTATIONS[name].description, mode=mode, batch=batch, seq=seq,
                         d_model=d_model, heads=heads, dtype=dtype, device=dev.type) for name in names}
    failed: dict[str, AttentionBenchResult] = {}
    made: dict[str, Callable] = {}  # every implementation's step
    steps: dict[str, Callable] = {}  # the ones timed together
    times: dict[str, Spread] = {}

    def time_steps(candidates: dict[str, Callable]) -> None:
        for name, step in list(candidates.items()):
            try:  # warm-up, and a broken kernel found before the rounds start
                step()
            except Exception as err:  # report and go on: one broken kernel must not hide the others' results
                failed[name] = _failure(err, common[name])
                del candidates[name]
        if candidates:
            times.update(interleaved(candidates, dev, rounds=rounds, warmup=0, min_sample_s=min_run_time / rounds))

    for name in names:
        reason = _skip_reason(name, mode, dev, torch_dtype, d_model)
        if reason is not None:
            failed[name] = AttentionBenchResult(status="skipped", reason=reason, median_ms=None, peak_mem_bytes=None,
                                                ratio_vs_sdpa=None, **common[name])
            continue
        try:
            _, made[name] = make_step(name, batch, seq, d_model, heads, torch_dtype, dev, mode)
        except Exception as err:
            failed[name] = _failure(err, common[name])
            continue
        if mode == "compiled":  # time it now: the next one's compilation resets this one's compiled code
            time_steps({name: made[name]})
        else:
            steps[name] = made[name]
    time_steps(steps)
    results = []
    for name in names:
        if name in failed:
            results.append(failed[name])
            continue
        ms = times[name].map(lambda s: s * 1e3)
        peak = None
        try:
            if memory and dev.type == "cuda":
                peak = peak_cuda_bytes(made[name], dev)
            elif memory:
                peak = run_in_fresh_process("helpers.measure.attention_bench:peak_memory_in_fresh_process", name=name,
                                            batch=batch, seq=seq, d_model=d_model, heads=heads, dtype=dtype,
                                            device=dev.type, mode=mode)
        except Exception as err:
            results.append(_failure(err, common[name]))
            continue
        results.append(AttentionBenchResult(status="ok", reason=None, median_ms=ms.median, peak_mem_bytes=peak,
                                            ratio_vs_sdpa=None, iqr_ms=ms.quartiles, **common[name]))
    if any(r.name == "sdpa" and r.status == "ok" for r in results):
        for r in results:
            if r.status == "ok":
                r.ratio_vs_sdpa = r.median_ms / (times["sdpa"].median * 1e3)
                r.differs_from_sdpa = not times[r.name].overlaps(times["sdpa"])
    return results


def _failure(err: Exception, common: dict) -> AttentionBenchResult:
    return AttentionBenchResult(status="error", reason=f"{type(err).__name__}: {err}"[:500], median_ms=None,
                                peak_mem_bytes=None, ratio_vs_sdpa=None, **common)


def results_as_dicts(results: list[AttentionBenchResult]) -> list[dict]:
    return [asdict(r) for r in results]


def format_results(results: list[AttentionBenchResult]) -> str:
    """A text table: one row per implementation, skipped ones with their reason. A ratio marked "~" is within
    the noise: its IQR overlaps SDPA's."""
    lines = [f"{'implementation':<18} {'median ms':>10} {'IQR ms':>17} {'vs sdpa':>8} {'peak MiB':>9}  note"]
    for r in results:
        ms = f"{r.median_ms:10.2f}" if r.median_ms is not None else f"{'-':>10}"
        iqr = f"{r.iqr_ms[0]:8.2f}–{r.iqr_ms[1]:<8.2f}" if r.iqr_ms is not None else f"{'-':>17}"
        ratio = f"{r.ratio_vs_sdpa:7.2f}x" if r.ratio_vs_sdpa is not None else f"{'-':>8}"
        if r.differs_from_sdpa is False and r.name != "sdpa":
            ratio = f"~{r.ratio_vs_sdpa:6.2f}x"
        mem = f"{r.peak_mem_bytes / 2**20:9.1f}" if r.peak_mem_bytes is not None else f"{'-':>9}"
        note = "" if r.status == "ok" else f"{r.status}: {r.reason}"
        lines.append(f"{r.name:<18} {ms} {iqr} {ratio} {mem}  {note}")
    if any(r.differs_from_sdpa is False and r.name != "sdpa" for r in results):
        lines.append("~: no measurable difference from sdpa (the IQRs of their timed runs overlap)")
    return "\n".join(lines)


# ---- which SDPA backend runs ----

_BACKEND_OPS = (("flash", "flash_attention"), ("efficient", "efficient_attention"), ("cudnn", "cudnn_attention"))


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def sdpa_backend_used(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> str:
    """The SDPA backend PyTorch dispatches to for these inputs, read from the aten op that ran."""
    with torch.no_grad(), _OpRecorder() as recorder:
        F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
    for op in recorder.ops:
        for key, backend in _BACKEND_OPS:
            if f"_scaled_dot_product_{key}" in op or f"_{key}_attention" in op:
                return backend
    return "math"


def grouped_attention_kernel(config: GPTConfig, batch: int, seq: int, dtype: torch.dtype, device: torch.device,
                             queries: int | None = None) -> str:
    """The SDPA kernel a model's attention runs on this device over `seq` keys, and for grouped-query attention
    whether its key/value heads are shared in the kernel or copied first (`helpers.model.attention.sdpa_grouped`).
    queries None: as many queries, causal (training, a prefill); a number: that many new queries with an explicit
    mask, as a KV cache or a paged serving engine asks (1 when decoding)."""
    masked = queries is not None
    q = torch.zeros(batch, config.n_heads, queries or seq, config.head_dim, device=device, dtype=dtype)
    k = torch.zeros(batch, config.kv_heads, seq, config.head_dim, device=device, dtype=dtype)
    mask = torch.ones(queries, seq, dtype=torch.bool, device=device).tril(seq - queries) if masked else None
    groups = config.n_heads // config.kv_heads
    shared = groups == 1 or fused_kernel_shares_kv_heads(q, k, k, mask, 0.0, not masked)
    if not shared:
        k = repeat_kv(k, groups)
    kernel = sdpa_backend_used(q, k, k, attn_mask=mask, is_causal=not masked, enable_gqa=shared and groups > 1)
    if groups == 1:
        return kernel
    return f"{kernel}, key/value heads {'shared in the kernel' if shared else 'copied to every query head'}"


def flash_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> str | None:
    """None when SDPA's flash backend accepts these inputs; else PyTorch's own reasons."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
            return None
        except RuntimeError as err:
            messages = [re.sub(r"\s*\(Triggered internally at .*?\)", "", str(w.message)).strip() for w in caught]
            return " ".join(m for m in messages if m) or str(err)


def _arguments(parser) -> None:
    add_scaled(parser, COMMAND, "batch", "sequences")
    add_scaled(parser, COMMAND, "seq", "tokens per sequence")
    add_scaled(parser, COMMAND, "d_model", "model width")
    add_scaled(parser, COMMAND, "heads", "attention heads")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    add_device(parser)
    parser.add_argument("--mode", choices=MODES, default="fwd",
                        help="fwd, fwdbwd (forward + backward), compiled (forward of torch.compile(module))")
    parser.add_argument("--only", nargs="+", choices=list(IMPLEMENTATIONS), metavar="NAME",
                        help=f"implementations to run (default: all of {', '.join(IMPLEMENTATIONS)})")
    parser.add_argument("--min-run-time", type=positive_float, default=0.5,
                        help="seconds of timed runs per implementation")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    add_json(parser, "a table", "a JSON list")


def _run(args) -> int:
    device = fill_scale_defaults(args, COMMAND)
    if args.d_model % args.heads:
        args.command_parser.error(f"--heads {args.heads} does not divide --d-model {args.d_model}; pick heads in "
                                  f"{[h for h in range(1, min(args.d_model, 64) + 1) if args.d_model % h == 0]}")
    results = bench_attention(batch=args.batch, seq=args.seq, d_model=args.d_model, heads=args.heads,
                              dtype=args.dtype, device=device, mode=args.mode, names=args.only,
                              min_run_time=args.min_run_time, memory=not args.no_memory)
    if args.json:
        print(json.dumps(results_as_dicts(results), indent=2))
    else:
        r = results[0]
        print(f"{r.mode}: batch {r.batch}, seq {r.seq}, d_model {r.d_model}, {r.heads} heads, {r.dtype} on {r.device}")
        print(format_results(results))
    return 1 if any(r.status == "error" for r in results) else 0


COMMAND = Command("bench-attention", "time every attention implementation on the same weights", _arguments, _run,
                  scale_defaults={"smoke": dict(batch=2, seq=128, d_model=128, heads=4),
                                  "cpu": dict(batch=2, seq=1024, d_model=768, heads=12),
                                  "gpu": dict(batch=8, seq=1024, d_model=768, heads=12)})
