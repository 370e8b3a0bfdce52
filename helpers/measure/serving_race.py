"""`python -m helpers serve-race --checkpoint FOLDER`: the course's server against its peers, one machine, one load.

The contenders serve the same folder (the course's export is also the Hugging Face layout):
- "course": `python -m helpers serve` (continuous batching, prefix caching);
- "course-static": the same server with the static-batching scheduler, behind the same HTTP front;
- "transformers": `transformers serve --continuous-batching`, Hugging Face's own OpenAI-compatible server.

All start once, then take turns: for each round and each concurrency, every contender in turn (the order rotates
by round) gets the same seeded load from `helpers.measure.load_test` while the others are paused (SIGSTOP: an idle
`transformers serve` keeps a core busy polling). Each round and level draws new prompts (a seed of its own, the same
for every contender), so a prefix cache cannot serve a level from the prompts of the one before. Each figure is the
median over the rounds, with its range.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from ..serving.server import LOOPBACK, ServerProcess, free_port, launch
from ..system.args import positive_int
from ..system.cli import Command, add_json
from .load_test import LoadRequest, concurrency_list, load_test, plot_levels, workload

CONTENDERS = ("course", "course-static", "transformers")
KEYS = ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p99_s", "errors")


def start_contender(name: str, folder: Path, max_batch: int, log_dir: Path,
                    timeout: float = 600.0) -> tuple[ServerProcess, str]:
    """The server and the model name its clients send; its output goes to LOG_DIR/NAME.log."""
    log = log_dir / f"{name}.log"
    if name == "transformers":
        executable = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
        if executable is None:
            raise RuntimeError("the transformers command is not installed: pip install 'transformers[serving]' "
                               "accelerate")
        port = free_port()
        command = [executable, "serve", str(folder), "--host", LOOPBACK, "--port", str(port), "--device", "cpu",
                   "--continuous-batching", "--cb-max-batch-tokens", str(max_batch * 64)]
        env = os.environ | {"HF_HUB_OFFLINE": "1"}
        return launch(command, port, timeout, env, log), str(folder)
    scheduling = "static" if name == "course-static" else "continuous"
    port = free_port()
    command = [sys.executable, "-m", "helpers", "serve", "--checkpoint", str(folder), "--port", str(port),
               "--max-batch", str(max_batch), "--scheduling", scheduling, "--max-waiting", "1024"]
    return launch(command, port, timeout, log=log), folder.resolve().name


def fitting_workload(folder: Path, n_requests: int, seed: int = 0) -> list[LoadRequest]:
    """`load_test.workload` whose every request fits the model's context (prompt + max_tokens <= context), so no
    server refuses one (a too-long prompt kills transformers serve's continuous-batching engine)."""
    from ..serving.checkpoint import load_for_serving

    served = load_for_serving(folder)
    context = served.context_length
    return workload(n_requests, seed, max_tokens=(8, min(48, context // 2)),
                    fits=lambda prompt, max_tokens: len(served.encode(prompt)) + max_tokens <= context)


def race(folder: str | os.PathLike, contenders: list[str], concurrencies: list[int], n_requests: int, rounds: int,
         max_seconds: float, max_batch: int = 64, seed: int = 0, progress=None,
         log_dir: str | os.PathLike | None = None) -> dict[str, list[list[dict]]]:
    """{contender: [round][level] summary}, runs interleaved as the module says. Each server's output goes to
    LOG_DIR/NAME.log (default: a temporary folder)."""
    folder = Path(folder)
    requests = {(r, c): fitting_workload(folder, n_requests, seed + 1000 * r + i)
                for r in range(rounds) for i, c in enumerate(concurrencies)}
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="serve-race-"))
    servers: dict[str, tuple[ServerProcess, str]] = {}
    try:
        for name in contenders:
            servers[name] = start_contender(name, folder, max_batch, log_dir)
            servers[name][0].pause()
        results: dict[str, list[list[dict]]] = {name: [] for name in contenders}
        for r in range(rounds):
            order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
            for name in contenders:
                results[name].append([])
            for c in concurrencies:
                for name in order:
                    server, model = servers[name]
                    server.resume()
                    try:
                        row = load_test(server.url, [c], requests[r, c], max_seconds, model)[0]
                    finally:
                        server.pause()
                    results[name][r].append(row)
                    if progress:
                        progress(f"round {r + 1}/{rounds}, {c} clients, {name}: {row['tokens_per_s']:.0f} tok/s")
        return results
    finally:
        for server, _ in servers.values():
            server.stop()


def medians(results: dict[str, list[list[dict]]]) -> dict[str, list[dict]]:
    """Per contender and concurrency: the median of each figure over the rounds, and its (min, max)."""
    out = {}
    for name, rounds in results.items():
        rows = []
        for level in zip(*rounds, strict=True):
            row = {"concurrency": level[0]["concurrency"], "requests": level[0]["requests"]}
            for key in KEYS:
                values = [r[key] for r in level]
                row[key] = statistics.median(values)
                row[key + "_range"] = (min(values), max(values))
            rows.append(row)
        out[name] = rows
    return out


def format_race(table: dict[str, list[dict]]) -> str:
    """Side by side: tokens/s, TTFT p50 and p99, ITL p99 (ms) and errors, median over rounds [min-max]."""
    lines = [f"{'clients':>7}  {'server':<14} {'tokens/s':>18} {'TTFT p50 ms':>18} {'TTFT p99 ms':>20} "
             f"{'ITL p99 ms':>16} {'errors':>6}"]
    names = list(table)
    for i, row in enumerate(table[names[0]]):
        for name in names:
            r = table[name][i]

            def cell(key, scale=1.0, digits=0, r=r):
                lo, hi = r[key + "_range"]
                return f"{r[key] * scale:.{digits}f} [{lo * scale:.{digits}f}-{hi * scale:.{digits}f}]"

            lines.append(f"{row['concurrency']:>7}  {name:<14} {cell('tokens_per_s'):>18} "
                         f"{cell('ttft_p50_s', 1e3):>18} {cell('ttft_p99_s', 1e3):>20} {cell('itl_p99_s', 1e3, 1):>16} "
                         f"{r['errors']:>6.0f}")
    return "\n".join(lines)


def _contender_list(text: str) -> list[str]:
    names = text.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    return names


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a model folder written by helpers.serving.checkpoint.export_for_serving")
    parser.add_argument("--contenders", type=_contender_list, default=list(CONTENDERS),
                        help=f"comma-separated, from {', '.join(CONTENDERS)} (default: all)")
    parser.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16, 64],
                        help="clients at once, one level each (default 1,4,16,64)")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests per level (default 64)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (default 2)")
    parser.add_argument("--max-seconds", type=float, default=120.0, help="a level's time limit (default 120)")
    parser.add_argument("--max-batch", type=positive_int, default=64, help="each server's batch (default 64)")
    parser.add_argument("--plot", help="save throughput and p99 TTFT against concurrency here")
    add_json(parser, shape="one JSON object of every round")


def _run(args: argparse.Namespace) -> int:
    if not (args.checkpoint / "config.json").is_file():
        args.command_parser.error(f"--checkpoint {args.checkpoint}: no model folder there (no config.json)")
    results = race(args.checkpoint, args.contenders, args.concurrency, args.requests, args.rounds, args.max_seconds,
                   args.max_batch, progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = medians(results)
    if args.plot:
        plot_levels(table, args.plot)
    print(json.dumps(results, indent=2) if args.json else format_race(table))
    return 0


COMMAND = Command("serve-race", "the course's server against transformers serve (and its static baseline), "
                  "interleaved under the same load", _arguments, _run)
