"""A small LLM inference engine: a paged KV cache, a ragged batched forward pass and two schedulers
(`helpers.inference.scheduler`).

Every iteration the scheduler picks a chunk of tokens per sequence (a whole or partial prompt, or the one
newest token while decoding), the engine runs them through the GPT as one ragged batch, and each sequence
whose tokens are all in the cache gets its next token (greedy, or drawn as its request's `sampling` says, from a
generator of its own). Linear layers see every sequence's tokens
concatenated; attention reads each sequence's keys and values through its block table (the one-token rows of
decoding sequences in one batched call, prompt chunks one by one).

* `scheduling="continuous"` — iteration-level scheduling (Orca, Yu et al. 2022; vLLM, Kwon et al. 2023):
  a finished sequence leaves the batch and frees its blocks at once, and waiting requests join in the same
  iteration. Blocks are taken as sequences grow; when none is free, the newest running sequence is preempted
  (its blocks freed, its tokens recomputed when it is scheduled again).
* `scheduling="static"` — the baseline: a batch of up to `max_batch` requests reserves its full length up
  front and runs until its longest request is done; finished rows keep computing (padding), as rows of a
  padded batch tensor do, and the next batch starts only then.

With `block_size=context_length` and `num_blocks=max_batch` (see `contiguous_layout`) the cache is the usual
contiguous one: a max-length row per sequence. With `prefix_caching=True` (continuous scheduling) requests that
share leading tokens share their KV blocks (`helpers.inference.prefix_cache`): a request skips the prefill of
its longest cached prefix.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from ..model.decoding import GREEDY, ContextExceeded, Sampling, check_context, check_decoding
from ..model.gpt import GPT
from .kv_format import KVFormat, as_kv_format
from .paged_kv import BatchRow, PagedBatch, PagedKVCache
from .scheduler import SCHEDULERS, Chunk, Request, SequenceState

SCHEDULINGS = tuple(SCHEDULERS)


@dataclass
class Completion:
    """What a request produced; times are seconds since the request was submitted."""

    request_id: Hashable
    prompt_len: int
    tokens: list[int]
    finish_reason: str  # "eos" or "length"
    first_token_s: float
    latency_s: float
    preemptions: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed (all admissions)


@dataclass(frozen=True)
class IterationStats:
    """One engine iteration. KV slots count tokens: `used` hold a live sequence's keys and values, `allocated`
    are all slots in blocks held by sequences (used, reserved for later tokens, or dead padding rows)."""

    end_s: float  # since the first iteration started
    batch: tuple[tuple[Hashable, int, str], ...]  # (request id, tokens, "prefill" | "decode" | "padding") per row
    used_slots: int
    allocated_slots: int
    waiting: int
    preempted: int  # sequences preempted in this iteration

    @property
    def tokens(self) -> int:
        return sum(n for _, n, _ in self.batch)

    @property
    def padding_rows(self) -> int:
        """Finished rows of a static batch, computed and thrown away."""
        return sum(kind == "padding" for _, _, kind in self.batch)


@dataclass
class ServingRun:
    """Completions (in submission order) and per-iteration statistics of one `Engine.run`."""

    completions: list[Completion]
    iterations: list[IterationStats]
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens (prompts not counted) per second of wall time."""
        return self.generated_tokens / self.wall_s

    @property
    def kv_utilization(self) -> float:
        """Used / allocated KV slots, summed over iterations (so weighted by how long memory is held). With prefix
        caching a shared slot is used by every sequence that reads it but allocated once, so this can exceed 1."""
        return sum(i.used_slots for i in self.iterations) / sum(i.allocated_slots for i in self.iterations)

    @property
    def preemptions(self) -> int:
        return sum(c.preemptions for c in self.completions)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens computed (prefill rows, recomputation after preemption included)."""
        return sum(n for i in self.iterations for _, n, kind in i.batch if kind == "prefill")

    @property
    def cached_tokens(self) -> int:
        """Prefill tokens that the prefix cache saved."""
        return sum(c.cached_tokens for c in self.completions)

    @property
    def prefix_hit_rate(self) -> float:
        """The share of the tokens to prefill that were found in the prefix cache."""
        return self.cached_tokens / (self.cached_tokens + self.prefill_tokens)

    def latency_percentiles(self, percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
        """Request latency (submission to last token) percentiles in seconds, e.g. {"p50": ..., "p90": ...}."""
        return percentiles_of([c.latency_s for c in self.completions], percentiles)

    def ttft_percentiles(self, percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, float]:
        """Time-to-first-token (submission to first new token) percentiles in seconds."""
        return percentiles_of([c.first_token_s for c in self.completions], percentiles)


class RequestRefused(ValueError):
    """A request an engine could never serve, with what to change. `field` names the `Request` field at fault
    ("prompt", "max_tokens", "eos_id" or "sampling") and `limit` the engine's limit it exceeds ("context": the
    model's context length; "cache": the KV cache's blocks; None: a malformed request), so a server can name its own
    field and give its own remedy."""

    def __init__(self, message: str, field: str, limit: str | None = None):
        super().__init__(message)
        self.field, self.limit = field, limit


def percentiles_of(values: list[float], percentiles: tuple[int, ...]) -> dict[str, float]:
    """{"p50": ..., ...} of `values` (linear interpolation, as numpy's default)."""
    x = torch.tensor(values, dtype=torch.float64)
    return {f"p{p}": torch.quantile(x, p / 100).item() for p in percentiles}


def contiguous_layout(context_length: int, max_batch: int) -> dict[str, int]:
    """Engine arguments for a contiguous max-length cache: one block of `context_length` slots per sequence."""
    return {"block_size": context_length, "num_blocks": max_batch}


class Engine:
    """Serve `Request`s with `model` (a `helpers.GPT`, weights untouched): `submit` queues, `step` runs one
    iteration, `run` steps until every submitted request is complete.

    `num_blocks` defaults to enough blocks for `max_batch` sequences of the full context length.
    `max_step_tokens` (default: the context length) caps the tokens of one iteration; longer prompts are
    prefilled in chunks over several iterations. `prefix_caching` shares the KV blocks of common prompt prefixes;
    `kv_cache_dtype="int8"` stores the cache in int8 (then outputs approximate the float model's).
    Each request gets the tokens `model.generate` picks for it alone, with its sampling and a generator seeded
    with its seed (exactly in float64; in float32 the batched kernels round differently from single-sequence ones).
    """

    def __init__(self, model: GPT, *, max_batch: int, block_size: int = 16, num_blocks: int | None = None,
                 scheduling: str = "continuous", max_step_tokens: int | None = None,
                 prefix_caching: bool = False, kv_cache_dtype: str | KVFormat = "auto") -> None:
        if scheduling not in SCHEDULINGS:
            raise ValueError(f"unknown scheduling {scheduling!r}; valid: {', '.join(SCHEDULINGS)}")
        stored_as = as_kv_format(kv_cache_dtype)
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"prefix_caching must be True or False, got {prefix_caching!r}")
        if prefix_caching and scheduling != "continuous":
            raise ValueError("prefix caching needs scheduling='continuous' (a static batch's padding rows rewrite "
                             "their last cached token, which others may share)")
        ctx = model.config.context_length
        for name, value in (("max_batch", max_batch), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        num_blocks = max_batch * math.ceil(ctx / block_size) if num_blocks is None else num_blocks
        self.max_step_tokens = ctx if max_step_tokens is None else max_step_tokens
        if not isinstance(self.max_step_tokens, int) or self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be a positive integer, got {max_step_tokens!r}")
        self.model, self.max_batch, self.scheduling = model, max_batch, scheduling
        param = next(model.parameters())
        self.cache = PagedKVCache(model.config.n_layers, model.config.kv_heads, model.config.head_dim, num_blocks,
                                  block_size, dtype=param.dtype, device=param.device, prefix_caching=prefix_caching,
                                  kv_format=stored_as)
        self.scheduler = SCHEDULERS[scheduling](self.cache, max_batch, self.max_step_tokens)
        self._live: dict[Hashable, SequenceState] = {}  # submitted, neither complete nor aborted
        self._submissions = itertools.count()  # orders `run`'s completions as the requests were submitted
        self._start: float | None = None
        self.last_iteration: IterationStats | None = None

    # ---- requests in ----

    def check(self, request: Request) -> None:
        """Raise RequestRefused if this engine could never serve `request` (its prompt, its length against the
        context and the cache, its sampling). The rules `submit` applies, for a caller that refuses a request before
        queuing it (the HTTP server answers 400 naming its own field); reads only the engine's fixed settings, so any
        thread may call it."""
        cfg, rid = self.model.config, request.request_id
        prompt = list(request.prompt)
        if not prompt:
            raise RequestRefused(f"request {rid!r}: the prompt is empty; give at least one token", "prompt")
        if not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in prompt):
            raise RequestRefused(f"request {rid!r}: prompt token ids must be integers in [0, {cfg.vocab_size})",
                                 "prompt")
        if request.eos_id is not None and not 0 <= request.eos_id < cfg.vocab_size:
            raise RequestRefused(f"request {rid!r}: eos_id {request.eos_id} is outside [0, {cfg.vocab_size})",
                                 "eos_id")
        if not isinstance(request.sampling, Sampling):
            raise RequestRefused(f"request {rid!r}: sampling must be a helpers.model.decoding.Sampling, got "
                                 f"{type(request.sampling).__name__}", "sampling")
        try:
            check_decoding(request.max_tokens, GREEDY, cfg.vocab_size)  # max_tokens alone: the sampling is next
        except ValueError as err:
            raise RequestRefused(f"request {rid!r}: {err}".replace("max_new_tokens", "max_tokens"),
                                 "max_tokens") from None
        try:
            request.sampling.check(cfg.vocab_size)
        except ValueError as err:
            raise RequestRefused(f"request {rid!r}: {err}", "sampling") from None
        try:
            cached = check_context(len(prompt), request.max_tokens, cfg.context_length)
        except ContextExceeded as err:  # the same rule as every decoder's, in a server's words
            if err.prompt_too_long:
                raise RequestRefused(f"request {rid!r}: the prompt has {len(prompt)} tokens but the context length "
                                     f"is {cfg.context_length}; shorten it (e.g. keep its last {cfg.context_length} "
                                     "tokens)", "prompt", "context") from None
            raise RequestRefused(f"request {rid!r}: a {len(prompt)}-token prompt plus {request.max_tokens} new "
                                 f"tokens needs {err.positions} positions but the context length is "
                                 f"{cfg.context_length}; set max_tokens to {cfg.context_length - len(prompt) + 1} or "
                                 "less", "max_tokens", "context") from None
        if self.cache.blocks_for(cached) > self.cache.num_blocks:
            raise RequestRefused(f"request {rid!r} needs {self.cache.blocks_for(cached)} blocks of "
                                 f"{self.cache.block_size} tokens but the cache has only {self.cache.num_blocks}; "
                                 "give the engine more num_blocks or lower max_tokens", "max_tokens", "cache")

    def submit(self, request: Request) -> None:
        """Queue a request. A request that could never be served raises ValueError here (`check`), with what to
        change; one that merely does not fit next to the others waits."""
        rid = request.request_id
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already queued or running; use unique ids")
        self.check(request)
        prompt = list(request.prompt)
        generator = None
        if not request.sampling.is_greedy:
            seed = request.seed if request.seed is not None else int(torch.randint(2**62, ()))
            generator = torch.Generator(self.cache.device).manual_seed(seed)
        seq = SequenceState(request, time.perf_counter(), tokens=prompt, generator=generator,
                            number=next(self._submissions))
        self._live[rid] = seq
        self.scheduler.waiting.append(seq)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a queued or running request (a client went away): it leaves the batch and its KV blocks are freed
        now, as a finished sequence's are. False if no such request is live (complete, aborted or unknown)."""
        seq = self._live.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        return True

    def generated(self, request_id: Hashable) -> list[int]:
        """The tokens a live request has generated so far (a copy), e.g. to stream them as they come."""
        return list(self._live[request_id].generated)

    @property
    def live_requests(self) -> int:
        return len(self._live)

    # ---- the forward pass ----

    def _forward(self, plan: list[Chunk]) -> torch.Tensor:
        """Logits (len(plan), vocab) after the last token of each planned chunk: the model's own forward pass over
        the ragged batch of chunks, its attention reading and writing the paged cache (`PagedBatch`)."""
        batch = PagedBatch(self.cache, [BatchRow(seq.request.request_id, start, n) for seq, start, n in plan])
        ids = torch.tensor([t for seq, start, n in plan for t in seq.tokens[start : start + n]],
                           device=self.cache.device)
        return self.model(ids.unsqueeze(0), cache=batch, logits_at=batch.last)[0]

    # ---- one iteration ----

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @staticmethod
    def _kind(seq: SequenceState, start: int) -> str:
        if seq.finish_reason is not None:
            return "padding"
        decode = start == len(seq.tokens) - 1 and start >= len(seq.request.prompt)  # feeds its newest token
        return "decode" if decode else "prefill"  # prefill: prompt tokens, or tokens recomputed after preemption

    @torch.inference_mode()
    def step(self) -> list[Completion]:
        """Schedule, run one forward pass, append a token to each sequence whose chunk reached its end.
        Returns the requests that completed in this iteration; `last_iteration` describes it (None when no pass ran:
        a static batch's finished rows leaving after its last unfinished one was aborted). A request's tokens so far
        are `generated(request_id)` until it completes."""
        if self._start is None:
            self._start = time.perf_counter()
        if self.scheduler.running and all(s.finish_reason is not None for s in self.scheduler.running):
            # a static batch whose last unfinished row was aborted: its finished rows leave without another pass
            self.last_iteration = None  # no pass ran
            return self._complete(self.scheduler.retire(), time.perf_counter())
        plan, preempted = self.scheduler.schedule()
        plan.sort(key=lambda chunk: chunk.length > 1)  # one-token chunks first: their attention is one batched call
        if not plan:
            raise RuntimeError("no sequence could be scheduled" if self.has_work else "nothing to run: submit first")
        if all(seq.finish_reason is not None for seq, _, _ in plan):  # only padding: no sequence would advance
            raise RuntimeError(f"the {self.scheduling} scheduler planned an iteration in which no sequence advances "
                               f"(max_step_tokens={self.max_step_tokens}, max_batch={self.max_batch}); this is a bug "
                               "in the engine: please report it with these settings")
        if self.model.training:  # (train() walks every module: skipped when the model is already in eval mode)
            self.model.eval()
            try:
                logits = self._forward(plan)
            finally:
                self.model.train()
        else:
            logits = self._forward(plan)
        next_ids = self._next_tokens(plan, logits)
        now = time.perf_counter()
        batch = tuple((seq.request.request_id, n, self._kind(seq, start)) for seq, start, n in plan)
        live = [s for s in self.scheduler.running if s.finish_reason is None]  # their caches were in use
        for (seq, start, n), token in zip(plan, next_ids, strict=True):
            if seq.finish_reason is not None:
                continue  # a padding row
            seq.num_computed = start + n
            self.cache.commit(seq.request.request_id, seq.tokens, seq.num_computed)
            if seq.num_computed < len(seq.tokens):
                continue  # a prompt chunk that is not the last one
            seq.tokens.append(token)
            seq.generated.append(token)
            seq.first_token = now if seq.first_token is None else seq.first_token
            if token == seq.request.eos_id:
                seq.finish_reason = "eos"
            elif len(seq.generated) == seq.request.max_tokens:
                seq.finish_reason = "length"
        self.last_iteration = IterationStats(
            end_s=now - self._start, batch=batch, used_slots=sum(s.num_computed for s in live),
            allocated_slots=self.cache.allocated_slots, waiting=len(self.scheduler.waiting), preempted=preempted)
        return self._complete(self.scheduler.retire(), now)

    def _complete(self, retired: list[SequenceState], now: float) -> list[Completion]:
        completions = []
        for seq in retired:
            del self._live[seq.request.request_id]
            completions.append(Completion(seq.request.request_id, len(seq.request.prompt), seq.generated,
                                          seq.finish_reason, seq.first_token - seq.submitted, now - seq.submitted,
                                          seq.preemptions, seq.cached_tokens))
        return completions

    @staticmethod
    def _next_tokens(plan: list[Chunk], logits: torch.Tensor) -> list[int]:
        """The token each planned row adds: greedy rows by one argmax over float32 logits (as GPT.generate), the
        others one by one with their own generator; rows that add no token (a prompt chunk short of the end,
        padding) draw nothing, so a request's draws follow its own tokens only."""
        tokens = logits.float().argmax(dim=-1).tolist()
        for row, (seq, start, n) in enumerate(plan):
            sampling = seq.request.sampling
            if sampling == GREEDY or seq.finish_reason is not None or start + n < len(seq.tokens):
                continue
            context = torch.tensor([seq.tokens], device=logits.device) if sampling.penalises else None
            tokens[row] = int(sampling.next_token(logits[row : row + 1], context, seq.generator))
        return tokens

    def run(self) -> ServingRun:
        """Step until every submitted request is complete. Returns the completions of the requests live when it was
        called (in submission order; those that completed in earlier `step` calls were returned by those), the
        iterations run and their wall time, measured from the first of them."""
        if not self._live:
            raise RuntimeError("nothing to run: submit requests first")
        order = {rid: seq.number for rid, seq in self._live.items()}
        completions, iterations = [], []
        self._start = None
        while self.has_work:
            completions += self.step()
            if self.last_iteration is not None:
                iterations.append(self.last_iteration)
        wall = time.perf_counter() - self._start
        return ServingRun(sorted(completions, key=lambda c: order[c.request_id]), iterations, wall)


def serve(model: GPT, requests: list[Request], **engine_args) -> ServingRun:
    """Submit every request at once (all arrive at t=0), then run the engine until all are complete."""
    engine = Engine(model, **engine_args)
    for request in requests:
        engine.submit(request)
    return engine.run()
