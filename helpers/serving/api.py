"""An OpenAI-compatible HTTP API over the engine loop: `/v1/completions`, `/v1/chat/completions` (streamed as
server-sent events or not), `/v1/models`, `/health`, `/metrics`, and a chat page at `/`.

Requests and responses have OpenAI's shapes, so the official `openai` client works unchanged; errors too: a 4xx with
`{"error": {"message", "type", "param", "code"}}`. A request is checked whole before it reaches the engine, so a bad
one costs the engine nothing; fields the engine cannot honour (`n` > 1, `logprobs`, `echo`, ...) are refused, never
ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from ..inference.scheduler import Request as EngineRequest
from ..inference.serving import RequestRefused
from ..model.decoding import Sampling
from ..text.tokenizer_files import token_bytes
from .checkpoint import ServedModel
from .engine_loop import EngineLoop, EngineStopped, QueueFull, Update
from .engine_process import EngineProcess
from .metrics import ServerMetrics
from .text_stream import TextStream

FINISH_REASONS = {"eos": "stop", "length": "length"}  # the engine's words -> OpenAI's
T = TypeVar("T")
UNSUPPORTED = {"echo": False, "logprobs": None, "top_logprobs": None, "best_of": 1, "suffix": None,
               "logit_bias": None, "tools": None, "functions": None, "response_format": None}


class APIError(Exception):
    """A request refused with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Generation(BaseModel):
    """The fields both endpoints share. Unknown fields are ignored, as OpenAI's API does; the ones it knows and this
    server cannot honour are refused (`UNSUPPORTED`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=1)] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n}: this server returns one choice per request; send n=1 (or several "
                                "requests)", "n")
        for name, default in UNSUPPORTED.items():
            if (self.model_extra or {}).get(name, default) not in (default, False, None):
                raise APIError(400, f"{name} is not supported by this server; leave it out", name)
        if self.stop is not None and any(not s for s in ([self.stop] if isinstance(self.stop, str) else self.stop)):
            raise APIError(400, "a stop string must not be empty", "stop")

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, vocab_size: int) -> Sampling:
        sampling = Sampling(temperature=self.temperature, top_k=self.top_k, top_p=None if self.top_p == 1 else
                            self.top_p, presence_penalty=self.presence_penalty,
                            frequency_penalty=self.frequency_penalty)
        try:
            sampling.check(vocab_size)
        except ValueError as err:
            raise APIError(400, str(err), str(err).split()[0]) from None
        return sampling


class CompletionRequest(Generation):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class BodyTooLarge(HTTPException):
    """Raised while a body is read: FastAPI passes an HTTPException through (it turns other errors into 400)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is over {max_bytes} bytes, the most this server reads")


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read whole (declared or streamed)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            too_big = APIError(413, BodyTooLarge(self.max_bytes).detail, code="body_too_large")
            return await too_big.response()(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


class AbortingStream(StreamingResponse):
    """A streamed response that aborts its request however it ends: finished (a no-op then), failed, or cancelled
    when the client went away, wherever the cancellation lands."""

    def __init__(self, abort: Callable[[], None], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.abort = abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.abort()


class AuthorizeAndCount:
    """ASGI middleware: /v1/ requests without `Authorization: Bearer API_KEY` get 401 (when a key is set), and every
    response is counted by `count(path, status)`. Plain ASGI, so the app below sees the client's own `receive`
    (a disconnect shows at once) and streams pass through untouched."""

    def __init__(self, app, api_key: str | None, count: Callable[[str, int], None]) -> None:
        self.app, self.api_key, self.count = app, api_key, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if self.api_key is not None and path.startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if given != f"Bearer {self.api_key}":
                self.count(path, 401)
                return await APIError(401, "missing or wrong API key: send the header Authorization: Bearer KEY",
                                      kind="authentication_error", code="invalid_api_key").response()(
                    scope, receive, send)
        status = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            self.count(path, status[0] if status else 500)


async def unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.1) -> T | None:
    """`work`'s result, or None (and `work` cancelled) once the client has disconnected."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
        return task.result()
    finally:
        task.cancel()


def create_app(served: ServedModel, loop: EngineLoop | EngineProcess, *, api_key: str | None = None,
               max_body_bytes: int = 1 << 20) -> FastAPI:
    """The server's application; starting it starts `loop`, shutting it down stops it."""
    metrics = ServerMetrics(loop)
    vocab, ctx = served.model.config.vocab_size, served.context_length

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not loop.alive:
            loop.start()
        yield
        await asyncio.to_thread(loop.stop, 30)

    app = FastAPI(title="GPT from scratch, fast", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    def endpoint(path: str) -> str:
        """The path, for the routes this app has; "other" for any other, so that a client trying paths cannot add
        series to /metrics without end."""
        return path if any(route.path == path for route in app.routes) else "other"

    app.add_middleware(AuthorizeAndCount, api_key=api_key, count=lambda path, status: metrics.requests.labels(
        endpoint(path), str(status)).inc())

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            return APIError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
                            ).response()
        where = [str(part) for part in first["loc"] if part != "body" and not str(part).startswith(("str", "list",
                                                                                                      "int"))]
        param = ".".join(where) or None
        return APIError(400, f"{param or 'the body'}: {first['msg']}", param).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        code = "body_too_large" if isinstance(err, BodyTooLarge) else None
        return APIError(err.status_code, str(err.detail), kind="invalid_request_error", code=code).response()

    def check_model(name: str) -> None:
        if name != served.name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served.name!r} "
                                "(GET /v1/models)", "model", code="model_not_found")

    def submit(body: Generation, prompt: list[int], prompt_param: str, max_tokens: int | None,
               queue: asyncio.Queue) -> str:
        """Check the request (the engine's rules, through `Engine.check`, in this API's field names), then queue it;
        returns its id."""
        if max_tokens is None:
            max_tokens = max(1, ctx - len(prompt) + 1)
        if body.seed is not None and not -(2**63) <= body.seed < 2**64:
            raise APIError(400, f"seed must be in [-2**63, 2**64), got {body.seed}", "seed")
        rid = f"cmpl-{uuid.uuid4().hex}"
        request = EngineRequest(rid, tuple(prompt), max_tokens, served.eos_id, body.sampling(vocab), body.seed)
        try:
            loop.engine.check(request)
        except RequestRefused as err:
            remedy = " (a server's KV blocks: start it with more --num-blocks)" if err.limit == "cache" else ""
            raise APIError(400, f"{err}{remedy}", prompt_param if err.field == "prompt" else err.field,
                           code="context_length_exceeded" if err.limit == "context" else None) from None
        event_loop = asyncio.get_running_loop()
        try:
            loop.submit(request, lambda update: event_loop.call_soon_threadsafe(queue.put_nowait, update))
        except QueueFull as err:
            raise APIError(429, f"{err}; retry later", kind="rate_limit_error", code="queue_full") from None
        except EngineStopped as err:
            raise APIError(503, str(err), kind="server_error") from None
        metrics.prompt_tokens.inc(len(prompt))
        return rid

    async def pieces(rid: str, stops: list[str], queue: asyncio.Queue, arrival: float,
                     count: list[int]) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish_reason) as the request's tokens arrive; the last piece has a finish reason. count[0]
        becomes the number of tokens generated. The request is aborted if the consumer stops early."""
        text = TextStream(lambda t: token_bytes(served.tokenizer, t), stops)
        last, ended = arrival, False
        try:
            while True:
                update: Update = await queue.get()
                now = time.perf_counter()
                if update.tokens:
                    (metrics.ttft if count[0] == 0 else metrics.itl).observe(now - last)
                    for _ in update.tokens[1:]:
                        metrics.itl.observe(0.0)
                    last = now
                count[0] += len(update.tokens)
                metrics.generation_tokens.inc(len(update.tokens))
                piece = "".join(text.push(t) for t in update.tokens if t != served.eos_id)
                if update.error is not None:
                    ended = True
                    raise APIError(500, update.error, kind="server_error")
                if update.finish_reason == "abort":  # the loop stopped under the request
                    ended = True
                    raise APIError(503, "the server is shutting down; retry elsewhere", kind="server_error")
                if text.stopped:
                    ended = update.finish_reason is not None
                    yield piece, "stop"
                    return
                if update.finish_reason is not None:
                    ended = True
                    yield piece + text.finish(), FINISH_REASONS[update.finish_reason]
                    return
                if piece:
                    yield piece, None
        finally:
            if not ended:
                loop.abort(rid)

    def usage(prompt: list[int], count: list[int]) -> dict:
        return {"prompt_tokens": len(prompt), "completion_tokens": count[0],
                "total_tokens": len(prompt) + count[0]}

    async def respond(request: Request, body: Generation, prompt: list[int], prompt_param: str,
                      max_tokens: int | None, chat: bool):
        body.check_supported()
        check_model(body.model)
        queue: asyncio.Queue = asyncio.Queue()
        arrival = time.perf_counter()
        rid = submit(body, prompt, prompt_param, max_tokens, queue)
        created, count = int(time.time()), [0]
        stream = pieces(rid, body.stops, queue, arrival, count)
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, streamed: bool, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            if not streamed:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            return {"index": 0, "delta": delta, "finish_reason": finish}

        def envelope(choices: list[dict], streamed: bool) -> dict:
            return {"id": rid, "object": kind + (".chunk" if streamed and chat else ""), "created": created,
                    "model": served.name, "choices": choices}

        if not body.stream:
            async def collect() -> list[tuple[str, str | None]]:
                async with contextlib.aclosing(stream):
                    return [part async for part in stream]  # (text, None)..., then (text, finish reason)

            parts = await unless_disconnected(request, collect())
            if parts is None:  # the client went away: the request was aborted, and nobody reads an answer
                return Response(status_code=499)
            text = "".join(piece for piece, _ in parts)
            return envelope([choice(text, parts[-1][1], False)], False) | {"usage": usage(prompt, count)}

        async def events() -> AsyncIterator[str]:
            first = True
            async with contextlib.aclosing(stream):
                try:
                    async for piece, finish in stream:
                        yield f"data: {json.dumps(envelope([choice(piece, finish, True, first)], True))}\n\n"
                        first = False
                except APIError as err:  # the status has gone out: the error travels as an event
                    yield f"data: {err.response().body.decode()}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            if body.stream_options is not None and body.stream_options.include_usage:
                yield f"data: {json.dumps(envelope([], True) | {'usage': usage(prompt, count)})}\n\n"
            yield "data: [DONE]\n\n"

        return AbortingStream(lambda: loop.abort(rid), events(), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        prompt = body.prompt if isinstance(body.prompt, list) else served.encode(body.prompt)
        limit = 16 if body.max_tokens is None else body.max_tokens
        return await respond(request, body, prompt, "prompt", limit, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        try:
            prompt = served.chat_ids([m.model_dump() for m in body.messages])
        except ValueError as err:
            raise APIError(400, str(err), "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, body, prompt, "messages", limit, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "gpt-from-scratch-fast", "max_model_len": ctx}]}

    @app.get("/health")
    async def health():
        if not loop.alive:
            raise APIError(503, "the engine loop has stopped", kind="server_error")
        return {"status": "ok", "model": served.name}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page():
        return resources.files(__package__).joinpath("static/chat.html").read_text(encoding="utf-8")

    app.state.metrics = metrics
    return app
