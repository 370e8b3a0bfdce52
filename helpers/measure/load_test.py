"""`python -m helpers load-test URL`: drive an OpenAI-compatible server with a seeded mix of streamed requests at
several concurrencies, and report what its clients see.

For each concurrency c, c clients send requests back to back (a closed loop) until the workload is done or the
level's time is up. Each request streams `/v1/completions` greedily (temperature 0, so two servers of the same
weights do the same work) and the client notes:
- TTFT, time to first token: from sending the request to the first event that carries text;
- ITL, inter-token latency: per request, the time from its first to its last text event over the tokens after the
  first ((last - first) / (tokens - 1), the usual "time per output token", with the tokens the server's usage
  reports, an end-of-text token included), so servers that put several tokens in one event are measured alike;
- output tokens/s and requests/s over the level's wall time, and the requests that failed.

Traffic goes only to a loopback address, is bounded in requests and seconds, and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..inference.serving import percentiles_of
from ..system.args import positive_int
from ..system.cli import Command, add_json

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft_s: float | None = None
    itl_s: float | None = None  # mean over the request's tokens after the first
    tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


def check_loopback(url: str) -> str:
    """The URL without a trailing slash; ValueError unless it is http(s) to this machine's loopback address."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or parts.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"{url}: the load generator sends traffic only to this machine's loopback address, e.g. "
                         "http://127.0.0.1:8000")
    return url.rstrip("/")


def workload(n_requests: int, seed: int = 0, prompt_words: tuple[int, int] = (8, 64),
             max_tokens: tuple[int, int] = (8, 48),
             fits: Callable[[str, int], bool] | None = None) -> list[LoadRequest]:
    """Seeded requests: prompts of uniform word counts cut from the course corpus (CPython's documentation),
    output lengths uniform in `max_tokens` (no stop strings, so each request generates exactly that many unless the
    model ends its text). With `fits(prompt, max_tokens)` (e.g. the model's tokenizer against its context), a
    prompt loses words from its end until it fits."""
    from ..text.data import load_corpus

    words = load_corpus().split()
    rng = random.Random(seed)
    out = []
    for _ in range(n_requests):
        n = rng.randint(*prompt_words)
        start = rng.randrange(len(words) - n)
        limit = rng.randint(*max_tokens)
        while n > 1 and fits is not None and not fits(" ".join(words[start : start + n]), limit):
            n -= 1
        out.append(LoadRequest(" ".join(words[start : start + n]), limit))
    return out


async def one_request(client, url: str, model: str, request: LoadRequest) -> RequestResult:
    """Stream one completion; parse its server-sent events for text and the usage the server reports."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    events = tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    now = time.perf_counter()
                    first, last, events = first or now, now, events + 1
    except Exception as err:  # noqa: BLE001 - any failure of a request is one error in the report
        return RequestResult(False, error=f"{type(err).__name__}: {err}"[:200])
    end = time.perf_counter()
    tokens = tokens or events  # a server that reports no usage: one token per event
    if first is None:
        return RequestResult(True, None, None, tokens, end - start)
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return RequestResult(True, first - start, itl, tokens, end - start)


async def run_level(url: str, model: str, requests: list[LoadRequest], concurrency: int,
                    max_seconds: float) -> tuple[list[RequestResult], float]:
    """c clients send the requests back to back; none starts after `max_seconds`, and a request that waits more
    than `max_seconds` for its next bytes is an error. Returns the results and the wall time."""
    import httpx

    queue = list(reversed(requests))
    results: list[RequestResult] = []
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(max_seconds, connect=30.0), limits=limits) as client:

        async def worker() -> None:
            while queue and time.perf_counter() - start < max_seconds:
                results.append(await one_request(client, url, model, queue.pop()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], wall_s: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    summary = {"concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
               "output_tokens": sum(r.tokens for r in ok), "wall_s": wall_s,
               "tokens_per_s": sum(r.tokens for r in ok) / wall_s, "requests_per_s": len(ok) / wall_s}
    for name, values in (("ttft", ttft), ("itl", itl)):
        shares = percentiles_of(values, PERCENTILES) if values else {f"p{p}": math.nan for p in PERCENTILES}
        summary |= {f"{name}_{p}_s": value for p, value in shares.items()}
    errors = [r.error for r in results if not r.ok]
    summary["first_error"] = errors[0] if errors else None
    return summary


def first_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_to_completion(coroutine: Coroutine):
    """asyncio.run(coroutine), also where an event loop already runs in this thread (a Jupyter kernel's): there it
    runs in a thread of its own, so a notebook calls the load generator as a script does."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


def load_test(url: str, concurrencies: list[int], requests: list[LoadRequest], max_seconds: float,
              model: str | None = None) -> list[dict]:
    """One summary per concurrency, each level on the same requests."""
    url = check_loopback(url)
    model = model or first_model(url)
    return [summarize(*run_to_completion(run_level(url, model, requests, c, max_seconds)), c)
            for c in concurrencies]


def format_table(rows: list[dict]) -> str:
    """One line per concurrency (times in ms)."""
    lines = [f"{'conc':>5} {'reqs':>5} {'errs':>5} {'tok/s':>8} {'req/s':>7} {'TTFT p50':>9} {'p90':>8} {'p99':>8} "
             f"{'ITL p50':>8} {'p90':>7} {'p99':>7}"]
    for r in rows:
        ms = {k: r[k] * 1e3 for k in r if k.endswith("_s") and k.startswith(("ttft", "itl"))}
        lines.append(f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>5} {r['tokens_per_s']:>8.1f} "
                     f"{r['requests_per_s']:>7.2f} {ms['ttft_p50_s']:>9.1f} {ms['ttft_p90_s']:>8.1f} "
                     f"{ms['ttft_p99_s']:>8.1f} {ms['itl_p50_s']:>8.1f} {ms['itl_p90_s']:>7.1f} "
                     f"{ms['itl_p99_s']:>7.1f}")
    return "\n".join(lines)


def plot_levels(runs: dict[str, list[dict]], path: str | None = None):
    """Output tokens/s and p99 TTFT against concurrency, one line per server (a log-2 concurrency axis)."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in runs.items():
        levels = [r["concurrency"] for r in rows]
        left.plot(levels, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        right.plot(levels, [r["ttft_p99_s"] * 1e3 for r in rows], marker="o", label=name)
    for ax, what in ((left, "output tokens/s"), (right, "p99 time to first token (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def concurrency_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give concurrencies as integers separated by commas, e.g. "
                                         "1,4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every concurrency must be 1 or more")
    return values


def int_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give LO,HI, two integers") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= LO <= HI")
    return low, high


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server, on this machine's loopback address (e.g. http://127.0.0.1:8000)")
    parser.add_argument("--model", help="the model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16, 64],
                        help="clients at once, one level each (default 1,4,16,64)")
    parser.add_argument("--requests", type=positive_int, default=64, help="requests per level (default 64)")
    parser.add_argument("--max-seconds", type=float, default=120.0,
                        help="no request starts after this many seconds of a level (default 120)")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    parser.add_argument("--prompt-words", type=int_range, default=(8, 64),
                        help="prompt lengths in words, uniform in LO,HI (default 8,64)")
    parser.add_argument("--max-tokens", type=int_range, default=(8, 48),
                        help="max_tokens per request, uniform in LO,HI (default 8,48)")
    parser.add_argument("--plot", help="save the plot of throughput and p99 TTFT against concurrency here")
    add_json(parser, shape="one JSON list of levels")


def _run(args: argparse.Namespace) -> int:
    try:
        url = check_loopback(args.url)
    except ValueError as err:
        args.command_parser.error(str(err))
    if not args.max_seconds > 0:
        args.command_parser.error(f"--max-seconds {args.max_seconds}: give a positive number of seconds")
    requests = workload(args.requests, args.seed, args.prompt_words, args.max_tokens)
    rows = load_test(url, args.concurrency, requests, args.max_seconds, args.model)
    if args.plot:
        plot_levels({url: rows}, args.plot)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows), file=sys.stdout)
    return 0


COMMAND = Command("load-test", "drive an OpenAI-compatible server on loopback at several concurrencies "
                  "(TTFT, inter-token latency, tokens/s)", _arguments, _run)

