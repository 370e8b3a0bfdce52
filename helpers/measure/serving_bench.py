"""Continuous vs static batching on one model and one mixed workload: throughput, latency percentiles, KV memory
utilisation, and a float64 check that both engines produce exactly the tokens of `GPT.generate`.

`python -m helpers bench-serve --help` runs it from the command line.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import torch

from ..inference.serving import Request, ServingRun, contiguous_layout, serve
from ..model.config import PRESETS, GPTConfig
from ..model.gpt import GPT
from ..system.args import positive_int
from ..system.cli import Command, add_device, add_json, add_scaled, fill_scale_defaults
from ..system.device import dtype_name
from ..text.data import load_token_ids
from .timing import Spread, verdict


def mixed_workload(n_requests: int, context_length: int, seed: int = 0,
                   token_ids: torch.Tensor | None = None) -> list[Request]:
    """Requests with mixed lengths, as in chat traces: prompts uniform in [ctx/32, ctx/4] tokens of the course
    corpus; output lengths (`max_tokens`, no EOS) log-uniform in [ctx/64, ctx/2], so many answers are short
    and a few are long."""
    if n_requests < 1:
        raise ValueError(f"n_requests must be 1 or more, got {n_requests}")
    if context_length < 8:
        raise ValueError(f"context_length must be 8 or more for a mixed workload, got {context_length}")
    ids = load_token_ids() if token_ids is None else token_ids
    g = torch.Generator().manual_seed(seed)
    prompt_lo, prompt_hi = context_length // 32 or 1, context_length // 4
    out_lo, out_hi = context_length // 64 or 1, context_length // 2
    prompt_lens = torch.randint(prompt_lo, prompt_hi + 1, (n_requests,), generator=g).tolist()
    log_out = torch.empty(n_requests, dtype=torch.float64).uniform_(math.log(out_lo), math.log(out_hi + 1),
                                                                    generator=g)
    out_lens = log_out.exp().floor().clamp(out_lo, out_hi).long().tolist()
    starts = torch.randint(0, len(ids) - prompt_hi, (n_requests,), generator=g).tolist()
    return [Request(i, tuple(ids[s : s + p].tolist()), o)
            for i, (s, p, o) in enumerate(zip(starts, prompt_lens, out_lens, strict=True))]


def reference_tokens(model: GPT, request: Request) -> list[int]:
    """The request generated alone by `GPT.generate` (full recompute, no cache), with its sampling and a generator
    seeded with its seed, cut after EOS."""
    device = next(model.parameters()).device
    sampling = request.sampling
    generator = None
    if not sampling.is_greedy:
        if request.seed is None:
            raise ValueError(f"request {request.request_id!r} samples without a seed: give it one to reproduce it")
        generator = torch.Generator(device).manual_seed(request.seed)
    out = model.generate(torch.tensor([request.prompt], device=device), request.max_tokens, sampling, generator)
    tokens = out[0, len(request.prompt) :].tolist()
    if request.eos_id in tokens:
        tokens = tokens[: tokens.index(request.eos_id) + 1]
    return tokens


def engine_arguments(context_length: int, max_batch: int, block_size: int, num_blocks: int | None = None) -> dict:
    """Arguments of the three engines compared. By default each gets the same KV memory: the contiguous cache's
    `max_batch` rows of `context_length` slots.

    * "continuous": iteration-level scheduling on the paged cache (the vLLM design);
    * "continuous_contiguous": the same scheduler, each sequence holding a max-length row (layout alone differs);
    * "static": static batching on the contiguous cache (scheduler and layout differ).
    """
    paged_blocks = max_batch * math.ceil(context_length / block_size) if num_blocks is None else num_blocks
    contiguous = contiguous_layout(context_length, max_batch)
    return {"continuous": {"max_batch": max_batch, "block_size": block_size, "num_blocks": paged_blocks},
            "continuous_contiguous": {"max_batch": max_batch, **contiguous},
            "static": {"max_batch": max_batch, "scheduling": "static", **contiguous}}


def check_token_identity(model: GPT, requests: list[Request], engines: dict[str, dict]) -> bool:
    """Run `requests` through each engine with a float64 copy of `model` and compare with `GPT.generate`."""
    model64 = copy.deepcopy(model).double().eval()
    expected = [reference_tokens(model64, r) for r in requests]
    return all([c.tokens for c in serve(model64, requests, **args).completions] == expected
               for args in engines.values())


def serve_interleaved(model: GPT, workload: list[Request], engines: dict[str, dict], repeats: int,
                      progress=None) -> dict[str, list[ServingRun]]:
    """Serve `workload` with each engine in turn, `repeats` rounds (A B A B ...: a busy moment of a shared machine
    falls on all alike), after one warm-up per engine on a few short requests. Every run of each engine."""
    max_batch = max(args["max_batch"] for args in engines.values())
    warmup = [Request(r.request_id, r.prompt, min(r.max_tokens, 4)) for r in workload[:max_batch]]
    every: dict[str, list[ServingRun]] = {name: [] for name in engines}
    for round_ in range(repeats):
        for name, args in engines.items():
            if progress is not None:
                progress(f"{name} ({round_ + 1}/{repeats})" if repeats > 1 else name)
            if round_ == 0:
                serve(model, warmup, **args)  # first calls allocate memory and pick kernels
            every[name].append(serve(model, workload, **args))
    return every


def bench_serve(model_name: str, n_requests: int, max_batch: int, block_size: int = 16, seed: int = 0,
                device: str = "cpu", num_blocks: int | None = None, repeats: int = 1, check_requests: int = 6,
                check_max_tokens: int = 8, progress=None) -> tuple[dict, dict[str, ServingRun]]:
    """Serve one mixed workload (all requests arrive at t=0) with each engine of `engine_arguments`; same model
    (random weights, seeded), same forward code. Returns the report and each engine's `ServingRun`.

    The engines run in turn, interleaved, `repeats` times (the schedule is the same every time; only the timing
    varies); each engine's tokens/s is the median with its interquartile range, and each keeps its median run.
    A timing-free figure stands beside it: generated tokens per forward pass (iteration).

    `token_identical`: the `check_requests` requests with the shortest prompts, each generating
    `check_max_tokens` tokens, served by every engine with fewer batch slots than requests, in float64, equal
    `GPT.generate`'s greedy tokens.
    `float32_same_tokens`: the share of workload requests whose float32 outputs agree between continuous and
    static batching (batched float32 kernels round differently, so a near-tie can flip a token).
    `progress`, if given, is called with each engine's name before it runs.
    """
    config = GPTConfig.from_preset(model_name, dropout=0.0)
    torch.manual_seed(seed)
    model = GPT(config).to(device).eval()
    workload = mixed_workload(n_requests, config.context_length, seed)
    engines = engine_arguments(config.context_length, max_batch, block_size, num_blocks)
    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, got {repeats}")
    every = serve_interleaved(model, workload, engines, repeats, progress)
    throughput = {name: Spread(tuple(r.tokens_per_s for r in rs)) for name, rs in every.items()}
    runs = {name: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for name, rs in every.items()}
    shortest = sorted(workload, key=lambda r: len(r.prompt))[:check_requests]  # GPT.generate recomputes everything
    check = [Request(r.request_id, r.prompt, check_max_tokens) for r in shortest]
    check_engines = engine_arguments(config.context_length, max(1, len(check) // 2), block_size)
    cont, stat = runs["continuous"], runs["static"]
    report = {
        "model": model_name, "device": device, "dtype": dtype_name(next(model.parameters()).dtype),
        "requests": n_requests, "max_batch": max_batch, "block_size": block_size, "repeats": repeats,
        "num_blocks": engines["continuous"]["num_blocks"], "seed": seed, "arrivals": "all at t=0",
        "prompt_tokens": sum(len(r.prompt) for r in workload), "generated_tokens": cont.generated_tokens,
        "throughput_ratio": throughput["continuous"].median / throughput["static"].median,
        "continuous_vs_static": verdict("continuous (paged)", throughput["continuous"], "static",
                                        throughput["static"]),
        "paged_vs_contiguous": verdict("paged", throughput["continuous"], "contiguous",
                                       throughput["continuous_contiguous"]),
        "kv_utilization_paged": cont.kv_utilization,
        "kv_utilization_contiguous": runs["continuous_contiguous"].kv_utilization,
        "kv_utilization_static": stat.kv_utilization,
    }
    for name, run in runs.items():
        q1, q3 = throughput[name].quartiles
        report |= {f"tokens_per_s_{name}": throughput[name].median, f"tokens_per_s_iqr_{name}": [q1, q3],
                   f"tokens_per_forward_{name}": run.generated_tokens / len(run.iterations)}
        report |= {f"wall_s_{name}": run.wall_s, f"iterations_{name}": len(run.iterations),
                   f"padding_rows_{name}": sum(i.padding_rows for i in run.iterations),
                   f"preemptions_{name}": run.preemptions}
        report |= {f"latency_{p}_s_{name}": value for p, value in run.latency_percentiles().items()}
    same = sum(a.tokens == b.tokens for a, b in zip(cont.completions, stat.completions, strict=True))
    report |= {"float32_same_tokens": same / n_requests, "token_identical_requests": len(check),
               "token_identical": check_token_identity(model, check, check_engines)}
    return report, runs


def format_report(report: dict) -> str:
    """The benchmark as a text table: one column per engine."""
    names = ("continuous", "continuous_contiguous", "static")
    head = (f"{report['requests']} requests (all at t=0), {report['prompt_tokens']} prompt and "
            f"{report['generated_tokens']} generated tokens; {report['model']} on {report['device']}, "
            f"{report['dtype']}, max batch {report['max_batch']}"
            + f"; median (IQR) of {report['repeats']} interleaved runs each")
    throughput = {n: report[f"tokens_per_s_{n}"] for n in names}
    utilization = {"continuous": report["kv_utilization_paged"], "static": report["kv_utilization_static"],
                   "continuous_contiguous": report["kv_utilization_contiguous"]}
    rows = [
        ("scheduling", "continuous", "continuous", "static"),
        ("KV cache", f"paged ({report['block_size']}-token blocks)", "contiguous rows", "contiguous rows"),
        ("generated tokens / s", *(f"{throughput[n]:.1f}" for n in names)),
        ("  IQR", *("{:.1f}–{:.1f}".format(*report[f"tokens_per_s_iqr_{n}"]) for n in names)),
        ("generated tokens / forward pass", *(f"{report[f'tokens_per_forward_{n}']:.2f}" for n in names)),
        ("wall time (s)", *(f"{report[f'wall_s_{n}']:.2f}" for n in names)),
        *[(f"latency {p} (s)", *(f"{report[f'latency_{p}_s_{n}']:.2f}" for n in names)) for p in ("p50", "p90", "p99")],
        ("iterations", *(str(report[f"iterations_{n}"]) for n in names)),
        ("padding rows computed", *(str(report[f"padding_rows_{n}"]) for n in names)),
        ("preemptions", *(str(report[f"preemptions_{n}"]) for n in names)),
        ("KV utilisation (used / allocated)", *(f"{utilization[n]:.1%}" for n in names)),
    ]
    lines = [head] + [f"{label:<34} {a:>24} {b:>22} {c:>16}" for label, a, b, c in rows]
    lines.append(f"throughput: {report['continuous_vs_static']}; {report['paged_vs_contiguous']}")
    lines.append(f"token-identical to GPT.generate in float64 ({report['token_identical_requests']} requests, "
                 f"every engine): {report['token_identical']}; float32 outputs equal between continuous and static: "
                 f"{report['float32_same_tokens']:.0%} of requests")
    return "\n".join(lines)


def shared_prefix_workload(n_requests: int, context_length: int, prefix_tokens: int, seed: int = 0,
                           token_ids: torch.Tensor | None = None) -> list[Request]:
    """Requests that all start with one `prefix_tokens`-token system prompt (a slice of the course corpus), each
    followed by its own question of ctx/32 to ctx/16 corpus tokens and answered with ctx/64 to ctx/16 tokens
    (uniform, no EOS): a chat service whose requests share their instructions."""
    if n_requests < 1:
        raise ValueError(f"n_requests must be 1 or more, got {n_requests}")
    q_lo, q_hi = max(1, context_length // 32), max(1, context_length // 16)
    out_lo, out_hi = max(1, context_length // 64), max(1, context_length // 16)
    if not 1 <= prefix_tokens <= context_length - q_hi - out_hi:
        raise ValueError(f"prefix_tokens must be between 1 and {context_length - q_hi - out_hi} for a context of "
                         f"{context_length} (questions up to {q_hi} and answers up to {out_hi} tokens follow it), "
                         f"got {prefix_tokens}")
    ids = load_token_ids() if token_ids is None else token_ids
    g = torch.Generator().manual_seed(seed)
    start = int(torch.randint(0, len(ids) - prefix_tokens, (1,), generator=g))
    prefix = tuple(ids[start : start + prefix_tokens].tolist())
    q_lens = torch.randint(q_lo, q_hi + 1, (n_requests,), generator=g).tolist()
    out_lens = torch.randint(out_lo, out_hi + 1, (n_requests,), generator=g).tolist()
    starts = torch.randint(0, len(ids) - q_hi, (n_requests,), generator=g).tolist()
    return [Request(i, prefix + tuple(ids[s : s + q].tolist()), o)
            for i, (s, q, o) in enumerate(zip(starts, q_lens, out_lens, strict=True))]


def bench_shared_prefix(model: GPT, workload: list[Request], max_batch: int, block_size: int = 16,
                        num_blocks: int | None = None, repeats: int = 3, check_requests: int = 4,
                        check_max_tokens: int = 8, progress=None) -> tuple[dict, dict[str, ServingRun]]:
    """Serve `workload` with continuous batching on the paged cache, without and with prefix caching (same model,
    same memory, runs interleaved `repeats` times after a warm-up). Returns the report and each engine's median
    run: tokens/s (median, IQR), time-to-first-token percentiles, prefill tokens computed and saved, hit rate;
    `token_identical`: `check_requests` requests served with prefix caching by a float64 copy equal
    `GPT.generate`'s greedy tokens."""
    if repeats < 1:
        raise ValueError(f"repeats must be 1 or more, got {repeats}")
    base = engine_arguments(model.config.context_length, max_batch, block_size, num_blocks)["continuous"]
    engines = {"no_sharing": base, "prefix_caching": {**base, "prefix_caching": True}}
    every = serve_interleaved(model, workload, engines, repeats, progress)
    throughput = {name: Spread(tuple(r.tokens_per_s for r in rs)) for name, rs in every.items()}
    ttft = {name: Spread(tuple(r.ttft_percentiles((50,))["p50"] for r in rs)) for name, rs in every.items()}
    runs = {name: sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2] for name, rs in every.items()}
    model64 = copy.deepcopy(model).double().eval()
    check = [Request(r.request_id, r.prompt, check_max_tokens) for r in workload[:check_requests]]
    expected = [reference_tokens(model64, r) for r in check]
    served = serve(model64, check, **{**engines["prefix_caching"], "max_batch": max(1, len(check) // 2)})
    report = {
        "model_parameters": sum(p.numel() for p in model.parameters()),
        "context_length": model.config.context_length, "device": str(next(model.parameters()).device),
        "dtype": dtype_name(next(model.parameters()).dtype), "requests": len(workload), "max_batch": max_batch,
        "block_size": block_size, "num_blocks": base["num_blocks"], "repeats": repeats,
        "shared_prefix_tokens": common_prefix_length([r.prompt for r in workload]),
        "prompt_tokens": sum(len(r.prompt) for r in workload),
        "generated_tokens": runs["prefix_caching"].generated_tokens,
        "throughput_ratio": throughput["prefix_caching"].median / throughput["no_sharing"].median,
        "ttft_ratio": ttft["prefix_caching"].median / ttft["no_sharing"].median,
        "throughput_verdict": verdict("prefix caching", throughput["prefix_caching"], "no sharing",
                                      throughput["no_sharing"]),
        "ttft_verdict": verdict("prefix caching", ttft["prefix_caching"], "no sharing", ttft["no_sharing"],
                                higher_is_better=False),
        "token_identical_requests": len(check),
        "token_identical": [c.tokens for c in served.completions] == expected,
    }
    for name, run in runs.items():
        report |= {f"tokens_per_s_{name}": throughput[name].median,
                   f"tokens_per_s_iqr_{name}": list(throughput[name].quartiles),
                   f"ttft_p50_s_{name}": ttft[name].median, f"ttft_p50_iqr_{name}": list(ttft[name].quartiles),
                   f"prefill_tokens_{name}": run.prefill_tokens, f"cached_tokens_{name}": run.cached_tokens,
                   f"prefix_hit_rate_{name}": run.prefix_hit_rate, f"wall_s_{name}": run.wall_s,
                   f"iterations_{name}": len(run.iterations), f"preemptions_{name}": run.preemptions}
        report |= {f"ttft_{p}_s_{name}": v for p, v in run.ttft_percentiles((90, 99)).items()}
        report |= {f"latency_{p}_s_{name}": v for p, v in run.latency_percentiles().items()}
    return report, runs


def common_prefix_length(prompts: list[tuple[int, ...]]) -> int:
    """How many leading tokens every prompt shares."""
    n = min(len(p) for p in prompts)
    return next((i for i in range(n) if len({p[i] for p in prompts}) > 1), n)


def format_prefix_report(report: dict) -> str:
    """The shared-prefix benchmark as a text table: without and with prefix caching."""
    names = ("no_sharing", "prefix_caching")
    head = (f"{report['requests']} requests (all at t=0) sharing a {report['shared_prefix_tokens']}-token prefix; "
            f"{report['prompt_tokens']} prompt and {report['generated_tokens']} generated tokens; "
            f"{report['model_parameters'] / 1e6:.1f}M parameters, context {report['context_length']}, on "
            f"{report['device']}, {report['dtype']}, max batch {report['max_batch']}, "
            f"{report['block_size']}-token blocks; median (IQR) of {report['repeats']} interleaved runs each")
    rows = [
        ("", "no sharing", "prefix caching"),
        ("generated tokens / s", *(f"{report[f'tokens_per_s_{n}']:.1f}" for n in names)),
        ("  IQR", *("{:.1f}–{:.1f}".format(*report[f"tokens_per_s_iqr_{n}"]) for n in names)),
        ("time to first token p50 (s)", *(f"{report[f'ttft_p50_s_{n}']:.3f}" for n in names)),
        ("  IQR", *("{:.3f}–{:.3f}".format(*report[f"ttft_p50_iqr_{n}"]) for n in names)),
        *[(f"time to first token {p} (s)", *(f"{report[f'ttft_{p}_s_{n}']:.3f}" for n in names))
          for p in ("p90", "p99")],
        ("latency p50 (s)", *(f"{report[f'latency_p50_s_{n}']:.2f}" for n in names)),
        ("prompt tokens computed", *(str(report[f"prefill_tokens_{n}"]) for n in names)),
        ("prompt tokens from the cache", *(str(report[f"cached_tokens_{n}"]) for n in names)),
        ("prefix-cache hit rate", *(f"{report[f'prefix_hit_rate_{n}']:.1%}" for n in names)),
        ("iterations", *(str(report[f"iterations_{n}"]) for n in names)),
        ("preemptions", *(str(report[f"preemptions_{n}"]) for n in names)),
    ]
    lines = [head] + [f"{label:<30} {a:>14} {b:>16}" for label, a, b in rows]
    lines.append(f"throughput: {report['throughput_verdict']} ({report['throughput_ratio']:.2f}x of medians); "
                 f"time to first token p50: {report['ttft_verdict']} ({report['ttft_ratio']:.2f}x)")
    lines.append(f"token-identical to GPT.generate in float64 with prefix caching "
                 f"({report['token_identical_requests']} requests): {report['token_identical']}")
    return "\n".join(lines)


def bench_shared_prefix_preset(model_name: str, n_requests: int, max_batch: int, block_size: int,
                               prefix_tokens: int | None = None, seed: int = 0, device: str = "cpu",
                               num_blocks: int | None = None, repeats: int = 1, progress=None) -> dict:
    """`bench_shared_prefix` for a preset with random weights (seeded) and `n_requests` requests that share
    `prefix_tokens` tokens (default: half the context). Returns the report."""
    config = GPTConfig.from_preset(model_name, dropout=0.0)
    prefix = config.context_length // 2 if prefix_tokens is None else prefix_tokens
    workload = shared_prefix_workload(n_requests, config.context_length, prefix, seed)
    torch.manual_seed(seed)
    model = GPT(config).to(device).eval()
    report, _ = bench_shared_prefix(model, workload, max_batch, block_size, num_blocks=num_blocks, repeats=repeats,
                                    progress=progress)
    return report


def _arguments(parser) -> None:
    parser.add_argument("--workload", choices=["mixed", "shared-prefix"], default="mixed",
                        help="mixed: continuous vs static batching on mixed lengths; shared-prefix: requests that "
                        "share a system prompt, without and with prefix caching (default: mixed)")
    parser.add_argument("--prefix-tokens", type=positive_int,
                        help="tokens of the shared prefix with --workload shared-prefix (default: half the context)")
    add_scaled(parser, COMMAND, "model", "preset, random weights", choices=list(PRESETS), type=str)
    add_scaled(parser, COMMAND, "requests", "requests in the mixed workload")
    add_scaled(parser, COMMAND, "max_batch", "sequences per batch")
    add_scaled(parser, COMMAND, "block_size", "tokens per KV block of the paged cache")
    parser.add_argument("--num-blocks", type=positive_int,
                        help="blocks of the paged cache (default: the contiguous cache's memory, max-batch rows)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs per engine, interleaved; the median and IQR of each are reported (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload (default: 0)")
    add_device(parser)
    add_json(parser, "a table")


def _run(args) -> int:
    if args.workload == "mixed" and args.prefix_tokens is not None:
        args.command_parser.error("--prefix-tokens is for --workload shared-prefix")
    device = fill_scale_defaults(args, COMMAND)

    def progress(name: str) -> None:
        print(f"serving with {name} ...", file=sys.stderr, flush=True)

    try:
        if args.workload == "mixed":
            report, _ = bench_serve(args.model, args.requests, args.max_batch, args.block_size, seed=args.seed,
                                    device=device, num_blocks=args.num_blocks, repeats=args.repeats,
                                    progress=progress)
        else:
            report = bench_shared_prefix_preset(args.model, args.requests, args.max_batch, args.block_size,
                                                args.prefix_tokens, args.seed, device, args.num_blocks, args.repeats,
                                                progress)
    except ValueError as err:  # e.g. --num-blocks too small for a request: say so, no traceback
        args.command_parser.error(str(err))
    text = format_report if args.workload == "mixed" else format_prefix_report
    print(json.dumps(report, indent=2) if args.json else text(report))
    return 0


COMMAND = Command("bench-serve", "continuous vs static batching (throughput, latency, KV memory); prefix caching on "
                  "a shared system prompt", _arguments, _run,
                  scale_defaults={"smoke": dict(model="gpt-smoke", requests=16, max_batch=4, block_size=8),
                                  "cpu": dict(model="gpt-cpu", requests=64, max_batch=16, block_size=8),
                                  "gpu": dict(model="gpt2-small", requests=256, max_batch=64, block_size=16)})
