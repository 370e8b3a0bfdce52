"""The serving engine in a process of its own, behind the same interface as `EngineLoop`.

In one process, the engine's thread and the HTTP front's event loop take turns holding Python's global interpreter
lock: every iteration's scheduling and sampling waits while a handler encodes a token's event, and the other way
round. In a process of its own the engine has its own interpreter, so the two run at once, each on its own core.

The child loads the model folder, builds the `Engine` and runs it in an `EngineLoop`. One pipe carries what the
server sends (submit, abort, stop) and another what the engine sends back (each request's updates, each new stats
snapshot). The server keeps the only count of live requests (so it refuses with 429 at once) and checks each
request against an engine built on the meta device: the same rules, no weights and no cache.

The child is started by spawning a fresh interpreter (about two seconds, most of it importing torch), which imports
the parent's main module again: a script that starts an EngineProcess keeps its top level under
`if __name__ == "__main__":`, as `python -m helpers serve` does.
"""

from __future__ import annotations

import multiprocessing
import signal
import threading
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..inference.scheduler import Request
from ..inference.serving import Engine
from .engine_loop import Deliver, EngineLoop, EngineStats, EngineStopped, QueueFull, Update


@dataclass(frozen=True)
class EngineSettings:
    """What the child needs to build the engine: the model folder, how to load it, and the engine's settings."""

    checkpoint: str
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None  # torch's CPU threads in the child (None: torch's default)
    max_batch: int = 64
    max_waiting: int = 256
    block_size: int = 16
    num_blocks: int | None = None
    scheduling: str = "continuous"
    prefix_caching: bool = True

    def engine(self, model) -> Engine:
        shares = self.scheduling == "continuous" and self.prefix_caching  # static scheduling never shares blocks
        return Engine(model, max_batch=self.max_batch, block_size=self.block_size, num_blocks=self.num_blocks,
                      scheduling=self.scheduling, prefix_caching=shares)


def _child(settings: EngineSettings, commands, events) -> None:
    """The engine process: build the engine, say "ready" (or why not), then serve commands until "stop" or until the
    server's end of the pipe closes (the server is gone)."""
    from ..system.device import DTYPES
    from .checkpoint import load_for_serving

    for sig in (signal.SIGINT, signal.SIGTERM):  # the server stops this process; a signal to them both is the server's
        signal.signal(sig, signal.SIG_IGN)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            events.send(message)

    try:
        served = load_for_serving(settings.checkpoint, device=settings.device, dtype=DTYPES[settings.dtype])
        loop = EngineLoop(settings.engine(served.model), settings.max_waiting,
                          publish=lambda stats: send(("stats", stats)))
    except Exception as err:  # noqa: BLE001 - the server reports it and exits
        send(("failed", f"{type(err).__name__}: {err}"))
        return
    send(("ready", loop.stats, torch.get_num_threads()))
    loop.start()
    reported = False
    try:
        while True:
            if loop.failure is not None and not reported:  # the engine's thread died: the server answers 503 now
                send(("failed", loop.failure))
                reported = True
            try:
                if not commands.poll(0.5):
                    continue
                command = commands.recv()
            except EOFError:
                break
            if command[0] == "submit":
                _, request = command
                rid = request.request_id
                try:
                    loop.submit(request, lambda update, rid=rid: send(("update", rid, update)))
                except (QueueFull, EngineStopped) as err:
                    send(("update", rid, Update((), "error", str(err))))
            elif command[0] == "abort":
                loop.abort(command[1])
            else:
                break
    finally:
        loop.stop(30)
        if loop.failure is not None and not reported:
            send(("failed", loop.failure))
        events.close()


class EngineProcess:
    """`EngineLoop`'s interface (`submit`, `abort`, `stats`, `alive`, `admitted`, `stop`, `failure`, `engine` for
    checking requests) over an engine in a child process. `start` returns once the child has built the engine, or
    raises EngineStopped with the child's error."""

    def __init__(self, settings: EngineSettings, model_on_meta) -> None:
        with torch.device("meta"):
            self.engine = settings.engine(model_on_meta)  # for `check`: the engine's rules, on the meta device
        self.capacity = settings.max_batch + settings.max_waiting
        self.stats = EngineStats(blocks_free=self.engine.cache.num_blocks)
        self.failure: str | None = None
        self.threads: int | None = None  # the child's torch threads, once it has started
        self._consumers: dict[Hashable, Deliver] = {}
        self._lock = threading.Lock()
        self._stopping = False
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of the server's threads
        child_commands, self._commands = context.Pipe(duplex=False)  # (the end that receives, the end that sends)
        self._events, child_events = context.Pipe(duplex=False)
        self._process = context.Process(target=_child, args=(settings, child_commands, child_events),
                                        name="engine", daemon=True)
        self._child_ends = (child_commands, child_events)
        self._reader = threading.Thread(target=self._read, name="engine-events", daemon=True)

    def start(self) -> EngineProcess:
        self._process.start()
        for end in self._child_ends:
            end.close()  # the child holds them now: the server's reads end when the child does
        message = self._receive()
        if message is None or message[0] != "ready":
            self.failure = message[1] if message else f"the engine process exited with code {self._process.exitcode}"
            self._process.join(30)
            raise EngineStopped(self.failure)
        _, self.stats, self.threads = message
        self._reader.start()
        return self

    def _receive(self):
        try:
            return self._events.recv()
        except (EOFError, OSError):
            return None

    def _read(self) -> None:
        """The server's side: hand each update to its request's consumer, keep the latest stats; when the child is
        gone, end every live request with the error."""
        while (message := self._receive()) is not None:
            if message[0] == "update":
                _, rid, update = message
                with self._lock:
                    deliver = self._consumers.get(rid)
                    if update.finish_reason is not None:
                        self._consumers.pop(rid, None)
                if deliver is not None:
                    deliver(update)
            elif message[0] == "stats":
                self.stats = message[1]
            else:  # "failed"
                self.failure = message[1]
        with self._lock:
            if self.failure is None and not self._stopping:
                self._process.join(5)
                self.failure = f"the engine process exited with code {self._process.exitcode}"
            consumers, self._consumers = list(self._consumers.values()), {}
        for deliver in consumers:
            deliver(Update((), "error" if self.failure else "abort", self.failure))

    def submit(self, request: Request, deliver: Deliver) -> None:
        with self._lock:
            if self._stopping or self.failure is not None:
                raise EngineStopped(self.failure or "the server is shutting down")
            if len(self._consumers) >= self.capacity:
                raise QueueFull(f"{len(self._consumers)} requests are running or waiting, the most this server holds")
            if request.request_id in self._consumers:
                raise ValueError(f"request id {request.request_id!r} is already live; use unique ids")
            self._consumers[request.request_id] = deliver
            self._commands.send(("submit", request))

    def abort(self, request_id: Hashable) -> None:
        """Drop a request whose client went away; the child frees its blocks before its next iteration."""
        with self._lock:
            if not self._stopping and self.failure is None:
                self._commands.send(("abort", request_id))

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self.failure is None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def admitted(self) -> int:
        with self._lock:
            return len(self._consumers)

    def stop(self, timeout: float | None = None) -> None:
        """End every live request with "abort" and let the child exit (waited for up to `timeout` seconds, then
        killed)."""
        with self._lock:
            if not self._stopping and self._process.is_alive():
                try:
                    self._commands.send(("stop",))
                except OSError:  # the child is gone already
                    pass
            self._stopping = True
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._commands.close()
        if self._reader.is_alive():
            self._reader.join(timeout)
