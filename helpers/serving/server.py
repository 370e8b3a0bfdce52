"""`python -m helpers serve --checkpoint FOLDER`, and `start_server`, which runs it in a child process for a notebook
or a test and always stops it.

The server binds to 127.0.0.1 unless told otherwise. On SIGTERM or Ctrl-C uvicorn stops accepting connections,
gives the open streams `--graceful-seconds` to finish, cancels the rest (their sequences are aborted, their blocks
freed), stops the engine loop, releases the port and exits 0.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..system.args import positive_int
from ..system.cli import Command, add_device
from ..system.device import DTYPES

LOOPBACK = "127.0.0.1"


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path,
                        help="a model folder written by helpers.serving.checkpoint.export_for_serving")
    parser.add_argument("--host", default=LOOPBACK, help=f"address to bind (default {LOOPBACK}: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    parser.add_argument("--model-name", help="the name clients call the model by (default: the folder's name)")
    parser.add_argument("--api-key", help="refuse /v1/ requests without the header Authorization: Bearer KEY")
    parser.add_argument("--max-batch", type=positive_int, default=64, help="sequences in one iteration (default 64)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests that may wait for the batch; past that, 429 at once (default 256)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--num-blocks", type=positive_int,
                        help="KV blocks, the cache's memory (default: max-batch sequences of the full context; "
                             "fewer: sequences wait or are preempted when the blocks run out)")
    parser.add_argument("--scheduling", choices=("continuous", "static"), default="continuous",
                        help="the engine's scheduler (default continuous; static is the baseline)")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not share KV blocks of common prefixes (continuous scheduling shares them by default; "
                             "static scheduling never does)")
    parser.add_argument("--max-body-bytes", type=positive_int, default=1 << 20,
                        help="largest request body read (default 1 MiB); larger ones get 413")
    parser.add_argument("--graceful-seconds", type=float, default=5.0,
                        help="on shutdown, how long open streams may finish before they are cancelled (default 5)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                        help="the weights' dtype (default float32; float64 makes batched and single-sequence "
                             "kernels agree exactly)")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads of the engine process (default: one per core but one, at least one: the "
                             "HTTP front, in this process, keeps a core)")
    add_device(parser, "cpu")


def run(args: argparse.Namespace) -> int:
    parser = args.command_parser
    if not args.checkpoint.is_dir():
        parser.error(f"--checkpoint {args.checkpoint}: no such folder; export one with "
                     "helpers.serving.checkpoint.export_for_serving")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port {args.port}: give a port in 1..65535")
    if args.max_waiting < 0:
        parser.error(f"--max-waiting {args.max_waiting}: give 0 or more")
    import uvicorn

    from ..model.hf_files import WeightsError
    from ..text.tokenizer_files import TokenizerFilesError
    from .api import create_app
    from .checkpoint import load_for_serving
    from .engine_loop import EngineStopped
    from .engine_process import EngineProcess, EngineSettings

    try:  # the front needs the model's shape and its tokenizer, not its weights: those are the engine's
        served = load_for_serving(args.checkpoint, name=args.model_name, device="meta", dtype=DTYPES[args.dtype])
    except (WeightsError, TokenizerFilesError) as err:
        parser.error(str(err))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or max(1, cores - 1)
    settings = EngineSettings(str(args.checkpoint), args.device or "cpu", args.dtype, threads, args.max_batch,
                              args.max_waiting, args.block_size, args.num_blocks, args.scheduling,
                              not args.no_prefix_caching)
    try:
        engine = EngineProcess(settings, served.model).start()
    except EngineStopped as err:
        print(f"serve: the engine did not start: {err}", file=sys.stderr)
        return 1
    app = create_app(served, engine, api_key=args.api_key, max_body_bytes=args.max_body_bytes)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.graceful_seconds)
    cache = engine.engine.cache
    mib = cache.num_blocks * cache.block_size * cache.bytes_per_slot / 2**20
    print(f"serving {served.name!r} at http://{args.host}:{args.port} (Ctrl-C stops); KV cache: {cache.num_blocks} "
          f"blocks of {cache.block_size} tokens, {mib:.0f} MiB; engine process with {engine.threads} CPU threads",
          flush=True)
    # uvicorn catches SIGINT and SIGTERM while it runs and, once shut down, raises the signal again for the handler
    # that was there before. A no-op one here: a server told to stop has stopped, and exits 0, not by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
    return 0


COMMAND = Command("serve", "serve a model folder over an OpenAI-compatible HTTP API", arguments, run)


class ServerProcess:
    """A server in a child process (in a session of its own, with any processes it starts): `url` once it answers
    /health; `stop()` ends them (SIGTERM, then SIGKILL after `timeout`); `pause()` and `resume()` freeze and thaw
    them, so a server waiting its turn in a benchmark takes no CPU. A context manager, so a notebook or a test never
    leaves a server behind; one still running when this interpreter exits (a notebook's kernel shut down) is
    stopped then."""

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process, self.url = process, url
        atexit.register(self.stop)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:  # already gone
            pass

    def pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for the exit; returns its exit code (SIGKILL if it has not exited within `timeout`)."""
        atexit.unregister(self.stop)
        if self.process.poll() is None:
            self.resume()
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self._signal(signal.SIGKILL)  # whatever the server started and left behind
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(command: list[str], port: int, timeout: float = 300.0, env: dict[str, str] | None = None,
           log: str | os.PathLike | None = None) -> ServerProcess:
    """Run `command` (a server that will listen on `port` of the loopback address) and wait until it answers
    /health: at most `timeout` seconds, failing at once if it exits. Its output goes to this process's stderr, or
    to the file `log` (whose end an error then quotes)."""
    output = open(log, "w") if log is not None else None  # noqa: SIM115 - the child writes it until it exits
    try:
        process = subprocess.Popen(command, stdout=output or subprocess.DEVNULL, stderr=output,
                                   env=env, start_new_session=True)
    finally:
        if output is not None:
            output.close()
    server = ServerProcess(process, f"http://{LOOPBACK}:{port}")
    deadline = time.monotonic() + timeout
    try:
        while True:
            if process.poll() is not None:
                where = "printed above" if log is None else \
                    "the end of its log: " + " | ".join(Path(log).read_text().strip().splitlines()[-3:])
                raise RuntimeError(f"the server exited with code {process.returncode} before answering /health "
                                   f"(command: {' '.join(command)}); its error is {where}")
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not answer {server.url}/health within {timeout:g} s")
            time.sleep(0.1)
    except BaseException:
        server.stop()
        raise


def start_server(checkpoint: str | os.PathLike, *options: str, timeout: float = 300.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """`python -m helpers serve --checkpoint CHECKPOINT OPTIONS...` on a free loopback port, once it answers
    /health (see `launch`)."""
    port = free_port()
    command = [sys.executable, "-m", "helpers", "serve", "--checkpoint", str(checkpoint), "--port", str(port),
               *options]
    return launch(command, port, timeout, env)
