"""Command line: `python -m helpers env [--json]`, `calibrate`, `bench-attention`, `flops`, `bench-load`, `bench-serve`,
`bench-decode`, `bench-train`, `run-notebooks`, `record`, `sync-bootstrap`; `python -m helpers COMMAND --help` for
each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .system.args import positive_float, positive_int

SCALES = ("smoke", "cpu", "gpu")
# The defaults that depend on the scale (helpers.system.scale: smoke when COURSE_SMOKE=1, else by the device),
# written once: the commands read them, and their --help shows them.
SCALE_DEFAULTS = {
    "bench-attention": {"smoke": dict(batch=2, seq=128, d_model=128, heads=4),
                        "cpu": dict(batch=2, seq=1024, d_model=768, heads=12),
                        "gpu": dict(batch=8, seq=1024, d_model=768, heads=12)},
    "bench-serve": {"smoke": dict(model="gpt-smoke", requests=16, max_batch=4, block_size=8),
                    "cpu": dict(model="gpt-cpu", requests=64, max_batch=16, block_size=8),
                    "gpu": dict(model="gpt2-small", requests=256, max_batch=64, block_size=16)},
    "bench-decode": {"smoke": dict(model="gpt-smoke", batch=[1, 4], positions=32),
                     "cpu": dict(model="gpt-cpu", batch=[1, 8, 32], positions=128),
                     "gpu": dict(model="gpt2-small", batch=[1, 16, 64], positions=512)},
    "bench-train": {"smoke": dict(model="gpt-smoke", batch=2, ctx=64, steps=2),
                    "cpu": dict(model="gpt-cpu", batch=4, ctx=128, steps=5),
                    "gpu": dict(model="gpt2-small", batch=8, ctx=1024, steps=10)},
}


def scale_help(command: str, dest: str, what: str) -> str:
    """`what`, then its default at each scale, read from SCALE_DEFAULTS."""
    values = ", ".join(f"{scale} {SCALE_DEFAULTS[command][scale][dest]}" for scale in SCALES)
    return f"{what} (default by scale: {values})"


def fill_scale_defaults(args: argparse.Namespace, command: str) -> str:
    """Set every option left out to its default at this device's scale; returns the device."""
    from .system.device import default_device_type
    from .system.scale import current_scale

    device = args.device or default_device_type()
    for dest, value in SCALE_DEFAULTS[command][current_scale(device)].items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    return device


def _env(args: argparse.Namespace) -> int:
    from .system.env import environment_report, format_report

    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from .measure.calibration import load_calibration
    from .system.device import autocast_dtype, default_device_type, detect_capabilities, dtype_name
    from .system.files import cache_dir

    device = args.device or default_device_type()
    dtypes = tuple(args.dtype or dict.fromkeys(["float32", dtype_name(autocast_dtype(detect_capabilities(device)))]))
    calibration = load_calibration(device, dtypes, refresh=args.refresh)
    if args.json:
        print(json.dumps({"key": calibration.key, **calibration.to_json()}, indent=2))
    else:
        print(calibration.report())
        print(f"cached in {cache_dir()}/calibration-{calibration.key}.json")
    return 0


def _bench_attention(args: argparse.Namespace) -> int:
    from .measure.attention_bench import bench_attention, format_results, results_as_dicts

    device = fill_scale_defaults(args, "bench-attention")
    batch, seq, d_model, heads = args.batch, args.seq, args.d_model, args.heads
    if d_model % heads:
        args.command_parser.error(f"--heads {heads} does not divide --d-model {d_model}; pick heads in "
                                  f"{[h for h in range(1, min(d_model, 64) + 1) if d_model % h == 0]}")
    results = bench_attention(
        batch=batch, seq=seq, d_model=d_model, heads=heads, dtype=args.dtype, device=device, mode=args.mode,
        names=args.only, min_run_time=args.min_run_time, memory=not args.no_memory,
    )
    if args.json:
        print(json.dumps(results_as_dicts(results), indent=2))
    else:
        r = results[0]
        print(f"{r.mode}: batch {r.batch}, seq {r.seq}, d_model {r.d_model}, {r.heads} heads, {r.dtype} on {r.device}")
        print(format_results(results))
    return 1 if any(r.status == "error" for r in results) else 0


def _flops(args: argparse.Namespace) -> int:
    from .measure.flops import flops_report, format_flops_report
    from .model.config import PRESETS

    config = PRESETS[args.model]
    ctx = config.context_length if args.ctx is None else args.ctx
    if ctx > config.context_length:
        args.command_parser.error(f"--ctx {ctx} is longer than {args.model}'s context length; pass --ctx "
                                  f"{config.context_length} or less")
    report = {"model": args.model, **flops_report(config, args.batch, ctx)}
    print(json.dumps(report, indent=2) if args.json else format_flops_report(report))
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    from .measure.load_bench import bench_load, format_results, results_as_dicts
    from .system.device import default_device_type

    results = bench_load(args.model, args.only, device=args.device or default_device_type(), repeats=args.repeats,
                         cold=args.cold, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(results_as_dicts(results), indent=2) if args.json else format_results(results))
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    from .measure import serving_bench

    if args.workload == "mixed" and args.prefix_tokens is not None:
        args.command_parser.error("--prefix-tokens is for --workload shared-prefix")
    device = fill_scale_defaults(args, "bench-serve")

    def progress(name: str) -> None:
        print(f"serving with {name} ...", file=sys.stderr, flush=True)

    try:
        if args.workload == "mixed":
            report, _ = serving_bench.bench_serve(args.model, args.requests, args.max_batch, args.block_size,
                                                  seed=args.seed, device=device, num_blocks=args.num_blocks,
                                                  repeats=args.repeats, progress=progress)
            text = serving_bench.format_report
        else:
            import torch

            from .model.config import GPTConfig
            from .model.gpt import GPT

            config = GPTConfig.from_preset(args.model, dropout=0.0)
            prefix = config.context_length // 2 if args.prefix_tokens is None else args.prefix_tokens
            workload = serving_bench.shared_prefix_workload(args.requests, config.context_length, prefix, args.seed)
            torch.manual_seed(args.seed)
            model = GPT(config).to(device).eval()
            report, _ = serving_bench.bench_shared_prefix(model, workload, args.max_batch, args.block_size,
                                                          num_blocks=args.num_blocks, repeats=args.repeats,
                                                          progress=progress)
            text = serving_bench.format_prefix_report
    except ValueError as err:  # e.g. --num-blocks too small for a request: say so, no traceback
        args.command_parser.error(str(err))
    print(json.dumps(report, indent=2) if args.json else text(report))
    return 0


def _bench_decode(args: argparse.Namespace) -> int:
    import torch

    from .measure.calibration import load_calibration
    from .measure.decode_bench import bench_decode, format_results, results_as_dicts
    from .model.config import GPTConfig
    from .model.gpt import GPT

    device = fill_scale_defaults(args, "bench-decode")
    config = GPTConfig.from_preset(args.model, dropout=0.0)
    if args.positions + 1 > config.context_length:
        args.command_parser.error(f"--positions {args.positions} leaves no room for a new token in {args.model}'s "
                                  f"context of {config.context_length}; pass {config.context_length - 1} or less")
    setups = tuple(args.setups)
    torch.manual_seed(0)
    model = GPT(config).to(device).eval()
    print("calibrating memory bandwidth (cached after the first run) ...", file=sys.stderr, flush=True)
    calibration = load_calibration(device)
    results = bench_decode(model, args.batch, args.positions, calibration, setups, rounds=args.rounds)
    print(json.dumps(results_as_dicts(results), indent=2) if args.json else format_results(results))
    return 0


def _bench_train(args: argparse.Namespace) -> int:
    from .measure.train_bench import bench_train, format_report
    from .model.config import PRESETS

    ctx_given = args.ctx is not None
    device = fill_scale_defaults(args, "bench-train")
    model, batch, steps = args.model, args.batch, args.steps
    ctx = args.ctx if ctx_given else min(args.ctx, PRESETS[model].context_length)
    if ctx > PRESETS[model].context_length:
        args.command_parser.error(f"--ctx {ctx} is longer than {model}'s context length; pass --ctx "
                                  f"{PRESETS[model].context_length} or less")
    try:
        report = bench_train(model, batch, ctx, steps, args.warmup, args.accumulation, device, args.until,
                             progress=True)
    except ValueError as err:  # sizes that cannot run: say which flag to change, no traceback
        args.command_parser.error(str(err))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _run_notebooks(args: argparse.Namespace) -> int:
    from .notebooks import ROOT, execute_notebook, find_notebooks, remaining_estimate
    from .system.scale import smoke_requested

    paths = [Path(p) for p in args.notebooks] or find_notebooks()
    smoke = args.smoke or smoke_requested()
    out = Path(args.out)
    print(f"executing {len(paths)} notebook(s) at {'smoke' if smoke else 'default'} scale into {out}/")
    failed = 0
    for i, path in enumerate(paths):
        rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else Path(path.name)
        print(f"[{i + 1}/{len(paths)}] {rel}{'' if smoke else remaining_estimate(paths, i)}", flush=True)
        run = execute_notebook(path, out / rel, smoke=smoke, timeout=args.timeout)
        failed += run.error is not None
        print(f"{'FAIL' if run.error else 'ok':>4}  {run.seconds:7.1f} s  {rel}", flush=True)
        if run.error:
            print(run.error[-3000:], file=sys.stderr)
    print(f"{len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _record(args: argparse.Namespace) -> int:
    import datetime
    import os
    import tempfile

    import torch

    from .notebooks import ROOT, busy_cores, execute_notebook, find_notebooks, remaining_estimate, update_readme
    from .system.device import detect_capabilities
    from .system.scale import current_scale

    paths = [Path(p).resolve() for p in args.notebooks] or find_notebooks()
    caps = detect_capabilities()
    threads = args.threads or os.cpu_count() or 1
    meta = {"machine": caps.name, "device": caps.device_type, "bf16_native": caps.bf16_native,
            "torch": torch.__version__, "threads": threads, "scale": current_scale(caps.device_type)}

    def quiet(when: str) -> bool:
        busy = busy_cores()
        if busy is None:
            print(f"  {when}: cannot read this machine's load (no /proc/stat); not checked")
            return True
        print(f"  {when}: other programs used {busy:.2f} cores (limit {args.max_busy})", flush=True)
        return busy <= args.max_busy or args.force

    print(f"recording {len(paths)} notebook(s) in place, one at a time: {meta}")
    for i, path in enumerate(paths):
        print(f"[{i + 1}/{len(paths)}] {path.parent.name}/{path.name}{remaining_estimate(paths, i)}", flush=True)
        if not quiet("before"):
            print("the machine is busy: stop what else runs, or pass --force to record anyway", file=sys.stderr)
            return 1
        date = datetime.datetime.now(datetime.UTC).date().isoformat()
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".record-") as tmp:  # same disk: an atomic move
            result = execute_notebook(path, Path(tmp) / path.name, smoke=False, timeout=args.timeout,
                                      threads=threads, metadata={**meta, "recorded": date})
            print(f"  {'FAIL' if result.error else 'ok'} in {result.seconds / 60:.1f} min", flush=True)
            if result.error:
                print(result.error[-3000:], file=sys.stderr)
                return 1
            if not quiet("after"):
                print(f"the machine got busy while {path.name} ran: its outputs are not saved; record it again "
                      "on a quiet machine, or pass --force", file=sys.stderr)
                return 1
            os.replace(Path(tmp) / path.name, path)
    if not args.notebooks or all(p.is_relative_to(ROOT) for p in paths):
        update_readme()  # the README's times and claims are the recording's
    return 0


def _sync_bootstrap(args: argparse.Namespace) -> int:
    from .notebooks import find_notebooks, sync_bootstrap

    for path in find_notebooks():
        if sync_bootstrap(path):
            print(f"updated {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    env = commands.add_parser("env", help="print the environment report")
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    env.set_defaults(func=_env)

    calibrate = commands.add_parser("calibrate", help="peak matmul FLOP/s and memory bandwidths of this machine "
                                    "(measured once, then cached)")
    calibrate.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: the course's device")
    calibrate.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16", "float16"],
                           help="dtypes whose peak to measure (default: float32 and the autocast dtype)")
    calibrate.add_argument("--refresh", action="store_true", help="measure again even if cached")
    calibrate.add_argument("--json", action="store_true", help="one JSON object (with every run) instead of text")
    calibrate.set_defaults(func=_calibrate)

    from .measure.attention_bench import MODES
    from .model.attention import IMPLEMENTATIONS
    from .system.device import DTYPES

    bench = commands.add_parser("bench-attention", help="time every attention implementation on the same weights")
    bench.add_argument("--batch", type=positive_int, help=scale_help("bench-attention", "batch", "sequences"))
    bench.add_argument("--seq", type=positive_int, help=scale_help("bench-attention", "seq", "tokens per sequence"))
    bench.add_argument("--d-model", type=positive_int, help=scale_help("bench-attention", "d_model", "model width"))
    bench.add_argument("--heads", type=positive_int, help=scale_help("bench-attention", "heads", "attention heads"))
    bench.add_argument("--dtype", choices=list(DTYPES), default="float32")
    bench.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: the best available")
    bench.add_argument("--mode", choices=MODES, default="fwd",
                       help="fwd, fwdbwd (forward + backward), compiled (forward of torch.compile(module))")
    bench.add_argument("--only", nargs="+", choices=list(IMPLEMENTATIONS), metavar="NAME",
                       help=f"implementations to run (default: all of {', '.join(IMPLEMENTATIONS)})")
    bench.add_argument("--min-run-time", type=positive_float, default=0.5,
                       help="seconds of timed runs per implementation")
    bench.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    bench.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    bench.set_defaults(func=_bench_attention, command_parser=bench)

    from .model.config import PRESETS

    flops = commands.add_parser("flops", help="forward FLOPs of a preset by hand, by fvcore and by FlopCounterMode")
    flops.add_argument("--model", choices=list(PRESETS), default="gpt2-small", help="preset (default: gpt2-small)")
    flops.add_argument("--batch", type=positive_int, default=2, help="sequences per batch (default: 2)")
    flops.add_argument("--ctx", type=positive_int, help="tokens per sequence (default: the preset's context length)")
    flops.add_argument("--json", action="store_true", help="one JSON object instead of text")
    flops.set_defaults(func=_flops, command_parser=flops)

    from .model.loading import STRATEGIES

    load = commands.add_parser("bench-load", help="peak memory and time of each weight-loading strategy")
    load.add_argument("--model", choices=list(PRESETS), default="gpt2-small",
                      help="preset whose size the random checkpoint has (default: gpt2-small)")
    load.add_argument("--only", nargs="+", choices=list(STRATEGIES), metavar="NAME",
                      help=f"strategies to run (default: all of {', '.join(STRATEGIES)})")
    load.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: the best available")
    load.add_argument("--repeats", type=positive_int, default=3,
                      help="fresh-process runs per strategy, interleaved; median and IQR (default: 3)")
    load.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before each run")
    load.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    load.set_defaults(func=_bench_load)

    serve = commands.add_parser("bench-serve", help="continuous vs static batching (throughput, latency, KV memory); "
                                "prefix caching on a shared system prompt")
    serve.add_argument("--workload", choices=["mixed", "shared-prefix"], default="mixed",
                       help="mixed: continuous vs static batching on mixed lengths; shared-prefix: requests that "
                       "share a system prompt, without and with prefix caching (default: mixed)")
    serve.add_argument("--prefix-tokens", type=positive_int,
                       help="tokens of the shared prefix with --workload shared-prefix (default: half the context)")
    serve.add_argument("--model", choices=list(PRESETS),
                       help=scale_help("bench-serve", "model", "preset, random weights"))
    serve.add_argument("--requests", type=positive_int,
                       help=scale_help("bench-serve", "requests", "requests in the mixed workload"))
    serve.add_argument("--max-batch", type=positive_int,
                       help=scale_help("bench-serve", "max_batch", "sequences per batch"))
    serve.add_argument("--block-size", type=positive_int,
                       help=scale_help("bench-serve", "block_size", "tokens per KV block of the paged cache"))
    serve.add_argument("--num-blocks", type=positive_int,
                       help="blocks of the paged cache (default: the contiguous cache's memory, max-batch rows)")
    serve.add_argument("--repeats", type=positive_int, default=3,
                       help="runs per engine, interleaved; the median and IQR of each are reported (default: 3)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload (default: 0)")
    serve.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: the best available")
    serve.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    serve.set_defaults(func=_bench_serve, command_parser=serve)

    from .measure.decode_bench import SETUPS

    decode = commands.add_parser("bench-decode", help="one decode step per setup and batch: tokens/s and the share of "
                                 "the calibrated memory bandwidth it uses (MBU)")
    decode.add_argument("--model", choices=list(PRESETS),
                        help=scale_help("bench-decode", "model", "preset, random weights"))
    decode.add_argument("--batch", type=positive_int, nargs="+",
                        help=scale_help("bench-decode", "batch", "batch sizes"))
    decode.add_argument("--positions", type=positive_int,
                        help=scale_help("bench-decode", "positions", "tokens of context when the step runs"))
    decode.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS), metavar="SETUP",
                        help=f"decoding setups (default: all of {', '.join(repr(s) for s in SETUPS)})")
    decode.add_argument("--rounds", type=positive_int, default=5, help="interleaved timing rounds (default: 5)")
    decode.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: the best available")
    decode.add_argument("--json", action="store_true", help="a JSON list instead of a table")
    decode.set_defaults(func=_bench_decode, command_parser=decode)

    from .measure.train_bench import LADDER

    train = commands.add_parser("bench-train", help="the training-speed ladder (tokens/s, MFU) and transformers' GPT-2")
    train.add_argument("--model", choices=list(PRESETS),
                       help=scale_help("bench-train", "model", "preset, random weights"))
    train.add_argument("--batch", type=positive_int,
                       help=scale_help("bench-train", "batch", "sequences per micro-batch"))
    train.add_argument("--ctx", type=positive_int,
                       help=scale_help("bench-train", "ctx", "tokens per sequence, at most the preset's context"))
    train.add_argument("--steps", type=positive_int,
                       help=scale_help("bench-train", "steps", "timed optimizer steps per rung; median and IQR"))
    train.add_argument("--warmup", type=positive_int, default=2,
                       help="untimed steps first, compilation included (default: 2)")
    train.add_argument("--accumulation", type=positive_int, default=4,
                       help="micro-batches per optimizer step on the accumulation rung (default: 4)")
    train.add_argument("--until", choices=LADDER, help="stop after this rung (e.g. accumulation: no torch.compile)")
    train.add_argument("--device", choices=["cpu", "cuda", "mps"], help="default: the best available")
    train.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    train.set_defaults(func=_bench_train, command_parser=train)

    run = commands.add_parser("run-notebooks", help="execute notebooks headless into a report folder")
    run.add_argument("notebooks", nargs="*", help="notebooks to run (default: every chapter's)")
    run.add_argument("--out", default="reports", help="folder for the executed copies (default: reports)")
    run.add_argument("--smoke", action="store_true", help="smoke scale (same as COURSE_SMOKE=1)")
    run.add_argument("--timeout", type=positive_int, default=900, help="seconds allowed per cell")
    run.set_defaults(func=_run_notebooks)

    record = commands.add_parser("record", help="re-record notebooks in place at the default scale, one at a time, "
                                 "on a quiet machine")
    record.add_argument("notebooks", nargs="*", help="notebooks to record (default: every chapter's)")
    record.add_argument("--threads", type=positive_int, help="torch threads in every notebook (default: all cores)")
    record.add_argument("--max-busy", type=positive_float, default=0.3,
                        help="most cores other programs may use before and after each notebook (default 0.3)")
    record.add_argument("--force", action="store_true", help="record even on a busy machine")
    record.add_argument("--timeout", type=positive_int, default=900, help="seconds allowed per cell")
    record.set_defaults(func=_record)

    sync = commands.add_parser("sync-bootstrap", help="write the bootstrap cell into every notebook")
    sync.set_defaults(func=_sync_bootstrap)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
