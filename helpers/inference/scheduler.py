"""Schedulers of the serving engine: which tokens of which sequences run in the next iteration, and the KV-cache
blocks they hold.

A plan is a list of chunks (sequence, first position, number of tokens): a whole or partial prompt, or the one
newest token of a decoding sequence. `ContinuousScheduler` schedules at the level of iterations (Orca, vLLM),
`StaticScheduler` a batch at a time (the baseline); `helpers.inference.serving.Engine` runs their plans.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..model.decoding import GREEDY, Sampling, cached_positions
from .paged_kv import PagedKVCache


@dataclass(frozen=True)
class Request:
    """A prompt (token ids) to complete with up to `max_tokens` tokens, stopping early at `eos_id`. Each token is
    picked by `sampling` (greedy by default); a sampling request draws from a generator of its own, seeded with
    `seed` (None: a seed drawn from torch's global generator when it is submitted), so its tokens do not depend on
    which requests share its batches."""

    request_id: Hashable
    prompt: tuple[int, ...]
    max_tokens: int
    eos_id: int | None = None
    sampling: Sampling = GREEDY
    seed: int | None = None


@dataclass
class SequenceState:
    """A request inside the engine: its tokens so far and how many of them are in the KV cache."""

    request: Request
    submitted: float
    tokens: list[int]  # prompt + generated so far
    num_computed: int = 0  # leading tokens whose keys and values are in the cache
    cached_tokens: int = 0  # tokens found in the prefix cache instead of computed, over all admissions
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_token: float | None = None
    preemptions: int = 0
    generator: torch.Generator | None = None  # a sampling request's own, on the cache's device
    number: int = 0  # the engine's count of submissions before this one


class Chunk(NamedTuple):
    """What one sequence runs in one iteration: `length` of its tokens from position `start`."""

    sequence: SequenceState
    start: int
    length: int


class Scheduler:
    """The waiting queue, the running batch and their KV blocks; subclasses decide what runs next."""

    def __init__(self, cache: PagedKVCache, max_batch: int, max_step_tokens: int) -> None:
        self.cache, self.max_batch, self.max_step_tokens = cache, max_batch, max_step_tokens
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # in admission order: the last one is the newest

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Chunk], int]:
        """The next iteration's chunks, and how many sequences were preempted to make room."""
        raise NotImplementedError

    def try_admit(self, seq: SequenceState, budget: int | None) -> bool:
        """Move the first waiting sequence into the batch if its blocks fit: with prefix caching it starts from
        the blocks of its longest cached prefix (`num_computed` jumps past those tokens); it reserves blocks for
        the tokens it runs now (the rest of its prompt, at most `budget` of them) or, with `budget=None`, for
        its full length. False (and no change) if the blocks do not fit."""
        rid = seq.request.request_id
        match = self.cache.match_prefix(seq.tokens)
        if budget is None:
            n_tokens = cached_positions(len(seq.tokens), seq.request.max_tokens)
        else:
            n_tokens = match.tokens + min(len(seq.tokens) - match.tokens, budget)
        if self.cache.blocks_to_attach(match, n_tokens) > self.cache.allocator.num_free:
            return False
        self.waiting.popleft()
        self.cache.attach(rid, match, n_tokens)
        seq.num_computed = match.tokens
        seq.cached_tokens += match.tokens
        self.running.append(seq)
        return True

    def remove(self, seq: SequenceState) -> None:
        """Take a sequence out of the queue or the batch at once (an aborted request) and free its blocks."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self.cache.release(seq.request.request_id)

    def retire(self) -> list[SequenceState]:
        """Remove the finished sequences from the batch and free their blocks; returns them."""
        done = [s for s in self.running if s.finish_reason is not None]
        for seq in done:
            self.running.remove(seq)
            self.cache.release(seq.request.request_id)
        return done


class ContinuousScheduler(Scheduler):
    """Iteration-level scheduling: a finished sequence leaves at once, waiting ones join in the same iteration;
    blocks are taken as sequences grow, and when none is free the newest running sequence is preempted."""

    def preempt(self, seq: SequenceState) -> None:
        """Free a running sequence's blocks and queue it first; its tokens are recomputed when it resumes."""
        self.running.remove(seq)
        self.cache.release(seq.request.request_id)
        seq.num_computed, seq.preemptions = 0, seq.preemptions + 1
        self.waiting.appendleft(seq)

    def schedule(self) -> tuple[list[Chunk], int]:
        """Running sequences first (oldest first), then new ones while slots, tokens and blocks last."""
        plan, budget, preempted = [], self.max_step_tokens, 0
        for seq in list(self.running):
            if seq not in self.running or budget == 0:
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            rid = seq.request.request_id
            while not self.cache.can_hold(rid, seq.num_computed + n):  # out of blocks: preempt the newest
                victim = self.running[-1]
                self.preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            if seq in self.running:
                self.cache.reserve(rid, seq.num_computed + n)
                plan.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        # new sequences join while there are slots, tokens and blocks; not in an iteration that had to preempt
        while self.waiting and len(self.running) < self.max_batch and budget > 0 and not preempted:
            seq = self.waiting[0]
            if not self.try_admit(seq, budget):
                break  # wait for blocks to be freed
            n = min(len(seq.tokens) - seq.num_computed, budget)
            plan.append(Chunk(seq, seq.num_computed, n))
            budget -= n
        return plan, preempted


class StaticScheduler(Scheduler):
    """A batch at a time: each sequence reserves its full length up front, and the batch runs until its longest
    request is done (finished rows keep computing, as padding)."""

    def schedule(self) -> tuple[list[Chunk], int]:
        """A new batch only when the last one is done; each reserves its full length; finished rows pad.

        Unfinished rows take the token budget first: a padding row only spends what is left, so a small
        `max_step_tokens` slows the batch down but cannot starve it."""
        if not self.running:
            while self.waiting and len(self.running) < self.max_batch:
                seq = self.waiting[0]
                if not self.try_admit(seq, budget=None):
                    break
        plan, budget = [], self.max_step_tokens
        for seq in self.running:
            if seq.finish_reason is None and budget > 0:
                n = min(len(seq.tokens) - seq.num_computed, budget)
                plan.append(Chunk(seq, seq.num_computed, n))
                budget -= n
        for seq in self.running:
            if seq.finish_reason is not None and budget > 0:  # padding: recompute its last cached token
                plan.append(Chunk(seq, seq.num_computed - 1, 1))
                budget -= 1
        return plan, 0

    def retire(self) -> list[SequenceState]:
        """The batch is held until its longest request is done."""
        if any(s.finish_reason is None for s in self.running):
            return []
        return super().retire()


SCHEDULERS = {"continuous": ContinuousScheduler, "static": StaticScheduler}
