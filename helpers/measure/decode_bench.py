"""Decode against its limit: tokens/s of one decode step and its model-bandwidth utilisation (MBU), per setup.

A decode step must read every weight once (the LM head reads the whole tied embedding) and, with a KV cache,
every cached key and value of every sequence, to produce one token per sequence. MBU = those bytes / step time /
the calibrated memory bandwidth (`helpers.measure.calibration`) of the level that holds them: 100% is the roof,
where decoding is as fast as reading its data allows. Without a cache the step recomputes every position, so
it reads the same weights but does far more arithmetic, and its MBU shows how far it is from the memory roof.

Each step runs at a fixed context: `positions` tokens are cached (or, without a cache, fed), one is added and
the cache is truncated back, so every sample times the same work.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..inference.compiled_decode import CompiledDecoder
from ..inference.kv_cache import KVCache
from ..inference.kv_format import KVFormat, as_kv_format
from ..inference.quantization import quantize_linears, tie_int8_embedding
from ..model.config import PRESETS, GPTConfig
from ..model.gpt import GPT
from ..system.args import positive_int
from ..system.cli import Command, add_device, add_json, add_scaled, fill_scale_defaults
from ..system.device import (
    DeviceCapabilities,
    autocast_dtype,
    check_dtype,
    detect_capabilities,
    dtype_name,
    parse_dtype,
)
from .calibration import Calibration
from .timing import Spread, interleaved

SETUPS = ("no cache", "cache", "compiled", "int8 weights", "int8 KV", "compiled int8", "compiled int8 KV")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, a tensor shared by two names (tied weights) counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers())}
    return sum(storages.values())


@dataclass(frozen=True)
class DecodeResult:
    """One setup at one batch size: seconds per decode step and the bytes the step must read."""

    setup: str
    batch: int
    positions: int  # tokens in the context of each sequence when the step runs
    step: Spread  # seconds per step
    bytes_per_step: int
    bandwidth: float  # calibrated bytes/s of the memory level that holds them
    level: str

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step.median

    @property
    def achieved_bandwidth(self) -> float:
        return self.bytes_per_step / self.step.median

    @property
    def mbu(self) -> float:
        """Model-bandwidth utilisation: the step's required bytes per second over the calibrated bandwidth."""
        return self.achieved_bandwidth / self.bandwidth


def _step_inputs(config: GPTConfig, batch: int, positions: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random context (batch, positions) and the new token (batch, 1), the same for every setup."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (batch, positions), generator=g).to(device)
    return prompt, torch.randint(0, config.vocab_size, (batch, 1), generator=g).to(device)


def _decode_step(model: GPT, batch: int, positions: int, kv_format: KVFormat,
                 device: torch.device) -> Callable[[], object]:
    """One decode step at a fixed context: the cache is prefilled once, each call adds a token and truncates it."""
    prompt, token = _step_inputs(model.config, batch, positions, device)
    cache = KVCache(model.config, batch, positions + 1, model.ln_f.weight.dtype, device, kv_format=kv_format)
    with torch.inference_mode():
        model(prompt, cache=cache, logits_at=torch.tensor([-1], device=device))

    def step():
        with torch.inference_mode():
            logits = model(token, cache=cache)
        cache.truncate(positions)
        return logits

    return step


def _compiled_step(model: GPT, batch: int, positions: int, kv_format: KVFormat, device: torch.device,
                   backend: str) -> Callable[[], object]:
    """The same step compiled over a static cache (`helpers.inference.compiled_decode`): each call rewrites the last
    slot. It is compiled here, before timing: the first call traces and compiles, the others replay."""
    prompt, token = _step_inputs(model.config, batch, positions, device)
    decoder = CompiledDecoder(model, batch, positions + 1, kv_cache_dtype=kv_format, backend=backend)
    decoder.prefill(prompt)
    position = torch.tensor([positions], device=device)

    def step():
        return decoder.step(token, position)

    step()
    return step


def _recompute_step(model: GPT, batch: int, positions: int, device: torch.device) -> Callable[[], object]:
    """Without a cache: the whole context and the new token through the model, logits at the last position."""
    g = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, model.config.vocab_size, (batch, positions + 1), generator=g).to(device)
    last = torch.tensor([-1], device=device)

    def step():
        with torch.inference_mode():
            return model(sequence, logits_at=last)

    return step


def bench_decode(model: GPT, batches: list[int], positions: int, calibration: Calibration,
                 setups: tuple[str, ...] = SETUPS, rounds: int = 5, backend: str = "inductor") -> list[DecodeResult]:
    """Time one decode step of `model` (eval, on its device, in its dtype) per setup and batch size, all
    interleaved. "int8 weights" quantizes a copy (weight-only, every Linear but the tied LM head; on any device);
    "compiled" compiles the step over a static cache once per batch size before timing (seconds each); "compiled
    int8" compiles a copy whose every Linear, the LM head included, is int8 weight-only, with the embedding reading
    the head's int8 rows (`quantization.tie_int8_embedding`), so the compiler can fuse each dequantization into its
    matrix multiply; "compiled int8 KV" compiles the step over an int8 cache. `backend`: torch.compile's ("eager"
    traces the whole step, fullgraph, and runs it without generating code: seconds less per setup, where only the
    path and the bytes matter)."""
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise ValueError(f"unknown setups {unknown}; valid: {', '.join(SETUPS)}")
    config, device = model.config, next(model.parameters()).device
    if positions < 1 or positions + 1 > config.context_length:
        raise ValueError(f"positions must be between 1 and {config.context_length - 1} for a context of "
                         f"{config.context_length}, got {positions}")
    model = model.eval()
    dtype = model.ln_f.weight.dtype
    models = {"int8 weights": quantize_linears(copy.deepcopy(model), "weight_only", skip=("lm_head",)).eval()
              if "int8 weights" in setups else None,
              "compiled int8": tie_int8_embedding(quantize_linears(copy.deepcopy(model), "weight_only")).eval()
              if "compiled int8" in setups else None}
    steps, required = {}, {}
    for batch in batches:
        for setup in setups:
            m = models.get(setup) or model
            kv_format = as_kv_format("int8" if setup.endswith("int8 KV") else "auto")
            cached = 0 if setup == "no cache" else batch * positions * kv_format.bytes_per_token(config, dtype)
            required[setup, batch] = weight_bytes(m) + cached
            if setup == "no cache":
                steps[setup, batch] = _recompute_step(m, batch, positions, device)
            elif setup.startswith("compiled"):
                steps[setup, batch] = _compiled_step(m, batch, positions, kv_format, device, backend)
            else:
                steps[setup, batch] = _decode_step(m, batch, positions, kv_format, device)
    times = interleaved(steps, device, rounds=rounds)
    results = []
    for (setup, batch), spread in times.items():
        level = calibration.level_for(required[setup, batch])
        results.append(DecodeResult(setup, batch, positions, spread, required[setup, batch],
                                    calibration.bandwidths[level].median, level))
    return results


def resolve_dtype(name: str, caps: DeviceCapabilities) -> torch.dtype:
    """The decode step's dtype: "auto" is the device's compute dtype (`autocast_dtype`, float32 where it has none);
    a named one is refused where the device cannot run it natively."""
    if name == "auto":
        return autocast_dtype(caps) or torch.float32
    return check_dtype(caps, parse_dtype(name))


def format_results(results: list[DecodeResult]) -> str:
    lines = [f"one decode step at {results[0].positions} tokens of context; median (IQR) of interleaved rounds",
             f"{'setup':<16} {'batch':>5} {'tokens/s':>10} {'ms/step (IQR)':>20} {'MB read':>9} {'GB/s':>7} "
             f"{'roof GB/s':>10} {'MBU':>6}"]
    for r in results:
        q1, q3 = r.step.quartiles
        step = f"{r.step.median * 1e3:.2f} ({q1 * 1e3:.2f}-{q3 * 1e3:.2f})"
        lines.append(f"{r.setup:<16} {r.batch:>5} {r.tokens_per_s:>10.1f} {step:>20} {r.bytes_per_step / 1e6:>9.1f} "
                     f"{r.achieved_bandwidth / 1e9:>7.2f} {f'{r.bandwidth / 1e9:.1f} {r.level}':>10} {r.mbu:>6.1%}")
    return "\n".join(lines)


def results_as_dicts(results: list[DecodeResult]) -> list[dict]:
    return [{"setup": r.setup, "batch": r.batch, "positions": r.positions, "step_s": r.step.median,
             "step_s_iqr": list(r.step.quartiles), "tokens_per_s": r.tokens_per_s,
             "bytes_per_step": r.bytes_per_step, "achieved_bandwidth": r.achieved_bandwidth,
             "bandwidth": r.bandwidth, "level": r.level, "mbu": r.mbu} for r in results]


def _arguments(parser) -> None:
    add_scaled(parser, COMMAND, "model", "preset, random weights", choices=list(PRESETS), type=str)
    add_scaled(parser, COMMAND, "batch", "batch sizes", nargs="+")
    add_scaled(parser, COMMAND, "positions", "tokens of context when the step runs")
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS), metavar="SETUP",
                        help=f"decoding setups (default: all of {', '.join(repr(s) for s in SETUPS)})")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                        help="the model's weights and activations (default: auto, the device's compute dtype: "
                             "bfloat16 where native, float16 on GPUs without it, float32 elsewhere)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved timing rounds (default: 5)")
    add_device(parser)
    add_json(parser, "a table", "a JSON list")


def _run(args) -> int:
    from .calibration import load_calibration

    device = fill_scale_defaults(args, COMMAND)
    config = GPTConfig.from_preset(args.model, dropout=0.0)
    if args.positions + 1 > config.context_length:
        args.command_parser.error(f"--positions {args.positions} leaves no room for a new token in {args.model}'s "
                                  f"context of {config.context_length}; pass {config.context_length - 1} or less")
    dtype = resolve_dtype(args.dtype, detect_capabilities(torch.device(device).type))
    torch.manual_seed(0)
    model = GPT(config).to(device, dtype).eval()
    print(f"{args.model} in {dtype_name(dtype)} on {device}", file=sys.stderr, flush=True)
    print("calibrating memory bandwidth (cached after the first run) ...", file=sys.stderr, flush=True)
    calibration = load_calibration(device)
    results = bench_decode(model, args.batch, args.positions, calibration, tuple(args.setups), rounds=args.rounds)
    print(json.dumps(results_as_dicts(results), indent=2) if args.json else format_results(results))
    return 0


COMMAND = Command("bench-decode", "one decode step per setup and batch: tokens/s and the share of the calibrated "
                  "memory bandwidth it uses (MBU)", _arguments, _run,
                  scale_defaults={"smoke": dict(model="gpt-smoke", batch=[1, 4], positions=32),
                                  "cpu": dict(model="gpt-cpu", batch=[1, 8, 32], positions=128),
                                  "gpu": dict(model="gpt2-small", batch=[1, 16, 64], positions=512)})
