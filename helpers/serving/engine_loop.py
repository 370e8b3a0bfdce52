"""The serving engine in one background thread, fed by requests that arrive at any time.

The HTTP handlers run in an asyncio event loop; the engine's iterations are seconds of compute that must not block
it. So one thread owns the `Engine`: between iterations it takes the requests and aborts that arrived (they join
the running batch at the next iteration, as continuous batching does) and, after each iteration, hands every live
request the tokens it gained. Nothing else touches the engine, so it needs no lock of its own.
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace

from ..inference.scheduler import Request
from ..inference.serving import Engine


class QueueFull(RuntimeError):
    """More requests than the engine's batch and its waiting room hold: the server answers 429 at once."""


class EngineStopped(RuntimeError):
    """The loop has stopped (shut down, or its thread failed): the server answers 503."""


@dataclass(frozen=True)
class Update:
    """What one iteration gave a request: its new tokens, and why it ended (None: not yet; "eos", "length", or
    "error" with the engine's message)."""

    tokens: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken after each iteration, for /metrics and /health."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    iterations: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    cached_tokens: int = 0  # prompt tokens of completed requests found in the prefix cache instead

    @property
    def prefix_hit_rate(self) -> float:
        """As `ServingRun.prefix_hit_rate`: the share of the tokens to prefill found in the prefix cache."""
        total = self.cached_tokens + self.prefill_tokens
        return self.cached_tokens / total if total else 0.0


Deliver = Callable[[Update], None]


class EngineLoop:
    """Runs `engine` in a daemon thread. `submit` and `abort` may be called from any thread; each request's
    `deliver` is called from the engine's thread after every iteration that gave it tokens, and once at its end.

    At most `max_batch + max_waiting` requests are live at once; `submit` raises QueueFull past that. `publish`, if
    given, gets every new stats snapshot, from the engine's thread (an engine process sends them to the server)."""

    def __init__(self, engine: Engine, max_waiting: int,
                 publish: Callable[[EngineStats], None] | None = None) -> None:
        self.engine, self.capacity = engine, engine.max_batch + max_waiting
        self._publish = publish
        self._stats = EngineStats(blocks_free=engine.cache.allocator.num_free)
        self._inbox: deque[tuple[str, Hashable, Request | None, Deliver | None]] = deque()
        self._wake = threading.Condition()
        self._live: dict[Hashable, tuple[Deliver, int]] = {}  # request id -> (deliver, tokens delivered); engine's
        self._admitted = 0  # requests taken by submit and not yet ended
        self._stopping = False
        self.failure: str | None = None  # why the thread died, if it did
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def submit(self, request: Request, deliver: Deliver) -> None:
        with self._wake:
            if self._stopping or self.failure is not None:
                raise EngineStopped(self.failure or "the server is shutting down")
            if self._admitted >= self.capacity:
                raise QueueFull(f"{self._admitted} requests are running or waiting, the most this server holds")
            self._admitted += 1
            self._inbox.append(("submit", request.request_id, request, deliver))
            self._wake.notify()

    def abort(self, request_id: Hashable) -> None:
        """Drop a request whose client went away; its blocks are freed before the next iteration."""
        with self._wake:
            self._inbox.append(("abort", request_id, None, None))
            self._wake.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @stats.setter
    def stats(self, snapshot: EngineStats) -> None:
        changed, self._stats = snapshot != self._stats, snapshot
        if changed and self._publish is not None:
            self._publish(snapshot)

    @property
    def admitted(self) -> int:
        """Requests submitted and not yet ended (running, waiting, or still on their way to the engine)."""
        with self._wake:
            return self._admitted

    def stop(self, timeout: float | None = None) -> None:
        """Finish nothing more: after the iteration under way, end every live request with "abort" and let the
        thread exit (waited for, up to `timeout` seconds, unless called from the thread itself)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine's thread ----

    def _end(self, request_id: Hashable, update: Update) -> None:
        deliver, _ = self._live.pop(request_id)
        with self._wake:
            self._admitted -= 1
        deliver(update)

    def _take_inbox(self) -> None:
        """Submit and abort what arrived; the stats then show the queue and the blocks as they are now."""
        while True:
            with self._wake:
                if not self._inbox:
                    break
                kind, rid, request, deliver = self._inbox.popleft()
            if kind == "abort":
                if self.engine.abort(rid):
                    self._end(rid, Update((), "abort"))
                continue
            if rid in self._live:
                with self._wake:
                    self._admitted -= 1
                deliver(Update((), "error", f"request id {rid!r} is already live; use unique ids"))
                continue
            self._live[rid] = (deliver, 0)
            try:
                self.engine.submit(request)
            except ValueError as err:  # the HTTP layer checks requests first; this is the engine's last word
                self._end(rid, Update((), "error", str(err)))
                continue
        scheduler, allocator = self.engine.scheduler, self.engine.cache.allocator
        self.stats = replace(self.stats, running=len(scheduler.running), waiting=len(scheduler.waiting),
                             blocks_used=allocator.num_used, blocks_free=allocator.num_free)

    def _run(self) -> None:
        """The loop; if it fails, every live request and every one still on its way ends with the error, and the
        loop refuses new ones (no client waits for a thread that is gone)."""
        try:
            self._serve()
        except BaseException as err:
            with self._wake:
                self.failure = f"the engine loop failed: {type(err).__name__}: {err}"
                consumers = [deliver for kind, _, _, deliver in self._inbox if kind == "submit"]
                consumers += [deliver for deliver, _ in self._live.values()]
                self._inbox.clear()
                self._admitted = 0
            for deliver in consumers:
                try:
                    deliver(Update((), "error", self.failure))
                except Exception:  # noqa: BLE001 - a consumer that is gone cannot be told
                    pass
            self._live.clear()
            traceback.print_exc()  # for whoever runs the server; the clients have been told

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or self.engine.has_work):
                    self._wake.wait()
                stopping = self._stopping
            self._take_inbox()
            if stopping:
                for rid in list(self._live):
                    self.engine.abort(rid)
                    self._end(rid, Update((), "abort"))
                return
            if not self.engine.has_work:
                continue
            try:
                completions = self.engine.step()
            except Exception as err:  # noqa: BLE001 - a failed iteration ends every request, and the server says so
                for rid in list(self._live):
                    self.engine.abort(rid)
                    self._end(rid, Update((), "error", f"the engine failed: {type(err).__name__}: {err}"))
                continue
            self.stats = self._snapshot(completions)
            for completion in completions:
                _, sent = self._live[completion.request_id]
                self._end(completion.request_id, Update(tuple(completion.tokens[sent:]), completion.finish_reason))
            for rid, (deliver, sent) in list(self._live.items()):
                tokens = self.engine.generated(rid)
                if len(tokens) > sent:
                    self._live[rid] = (deliver, len(tokens))
                    deliver(Update(tuple(tokens[sent:])))

    def _snapshot(self, completions: list) -> EngineStats:
        scheduler, allocator, last = self.engine.scheduler, self.engine.cache.allocator, self.engine.last_iteration
        return EngineStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting), blocks_used=allocator.num_used,
            blocks_free=allocator.num_free, iterations=self.stats.iterations + 1,
            prefill_tokens=self.stats.prefill_tokens + (0 if last is None else
                                                        sum(n for _, n, kind in last.batch if kind == "prefill")),
            cached_tokens=self.stats.cached_tokens + sum(c.cached_tokens for c in completions))
