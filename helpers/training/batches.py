"""What the Trainer draws its batches from: a seeded shuffle of examples, epoch after epoch, whose position is saved
with a checkpoint so a resumed run sees exactly the batches the uninterrupted run would have seen.

`ShuffledBatches` serves a token stream's non-overlapping windows (pretraining); `ExchangeBatches` serves chat
exchanges, padded or packed, their targets masked outside the answers (instruction tuning, `helpers.text.chat`).
Any object with `next()`, `state_dict()`, `load_state_dict()`, `batch_size` and `tokens_sha256` will do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..text.chat import ChatExample, packed_batch, padded_batch
from ..text.data import NextTokenDataset
from .checkpoint import CheckpointError

Batch = tuple[torch.Tensor, torch.Tensor]


class Batches(Protocol):
    """A source of training batches (x, y) in a reproducible order that a checkpoint can restore."""

    batch_size: int  # examples per batch
    tokens_sha256: str  # which data this is: a checkpoint resumes (or stands in for) a run only on the same data

    def next(self) -> Batch: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class SeededEpochs:
    """Epochs of `items` in a shuffled order drawn from `seed` and the epoch, `batch_size` per batch (the
    remainder dropped each epoch), each batch made by `collate`."""

    def __init__(self, items: Sequence, batch_size: int, seed: int, collate: Callable[[list], Batch],
                 tokens_sha256: str) -> None:
        if len(items) < batch_size:
            raise ValueError(f"{len(items)} examples cannot fill one batch of {batch_size}; use a smaller batch or "
                             "more data")
        self.items, self.batch_size, self.seed, self.collate = items, batch_size, seed, collate
        self.tokens_sha256 = tokens_sha256
        self.batches_per_epoch = len(items) // batch_size
        self.epoch, self.index = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(len(self.items), generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))

    def next(self) -> Batch:
        if self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        chosen = self._order[self.index * self.batch_size : (self.index + 1) * self.batch_size]
        self.index += 1
        return self.collate([self.items[int(i)] for i in chosen])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "batch_size": self.batch_size,
                "windows": len(self.items), "tokens_sha256": self.tokens_sha256}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "windows", "tokens_sha256"):
            if state.get(key, mine[key]) != mine[key]:  # (checkpoints before the digest lack it)
                raise CheckpointError(f"the checkpoint's data order has {key} = {state[key]}, this run {mine[key]}: "
                                      "resume with the same data, batch_size and seed")
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._permutation(self.epoch)


def stack_pairs(pairs: list[Batch]) -> Batch:
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


class ShuffledBatches(SeededEpochs):
    """Epochs of shuffled, non-overlapping context windows of a token stream."""

    def __init__(self, ids: torch.Tensor, batch_size: int, context_length: int, seed: int = 0) -> None:
        dataset = NextTokenDataset(ids, context_length)
        if len(dataset) < batch_size:
            raise ValueError(f"{len(dataset)} windows of {context_length} tokens cannot fill one batch of "
                             f"{batch_size}; use a smaller batch or context, or more text")
        super().__init__(dataset, batch_size, seed, stack_pairs,
                         hashlib.sha256(ids.cpu().numpy().tobytes()).hexdigest())
        self.dataset = dataset


class ExchangeBatches(SeededEpochs):
    """Epochs of shuffled chat exchanges (`helpers.text.chat.ChatExample`), each batch padded to its longest
    exchange or, with `pack_length`, packed end to end into rows of that many tokens."""

    def __init__(self, examples: Sequence[ChatExample], batch_size: int, pad_id: int, seed: int = 0,
                 pack_length: int | None = None) -> None:
        digest = hashlib.sha256(repr((pad_id, pack_length)).encode())  # the same examples batched otherwise differ
        for example in examples:
            digest.update(torch.tensor([example.answer_start, *example.ids]).numpy().tobytes())
        collate = ((lambda chosen: padded_batch(chosen, pad_id)) if pack_length is None
                   else (lambda chosen: packed_batch(chosen, pack_length, pad_id)))
        super().__init__(examples, batch_size, seed, collate, digest.hexdigest())


def evaluation_windows(ids: torch.Tensor, context_length: int, n_windows: int) -> Batch:
    """The same `n_windows` windows, evenly spread over the validation text, at every evaluation."""
    dataset = NextTokenDataset(ids, context_length)
    picks = torch.linspace(0, len(dataset) - 1, min(n_windows, len(dataset))).long().unique()
    return stack_pairs([dataset[int(i)] for i in picks])
