"""Automatic batch sizing: the search against fake memory limits, out-of-memory handling, and a real CPU budget."""

import math

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.measure.batch_size import (
    BatchSizeError,
    CpuMemoryBudget,
    cuda_step_fits,
    head_settings,
    largest_batch_size,
    make_training_step,
)
from helpers.training.step import FULL, ChunkedLoss, DistillationLoss, FullLoss, head_loss

TINY = GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=2, dropout=0.0)


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 8, 13, 100, 513, 1023, 1024])
def test_search_finds_the_threshold_in_few_tries(threshold):
    search = largest_batch_size(lambda b: b <= threshold, limit=1024)
    assert search.batch_size == threshold
    assert all(ok == (b <= threshold) for b, ok in search.tried)
    assert len(search.tried) <= 2 * math.log2(1024) + 1
    assert search.limit_reached == (threshold == 1024)


def test_search_stops_at_the_limit_and_respects_the_start():
    search = largest_batch_size(lambda b: True, start=3, limit=20)
    assert search.batch_size == 20 and search.limit_reached
    assert [b for b, _ in search.tried] == [3, 6, 12, 20]
    assert largest_batch_size(lambda b: b <= 7, start=3, limit=20).batch_size == 7


def test_nothing_fits_or_bad_bounds_are_clear_errors():
    with pytest.raises(BatchSizeError, match="batch size 1 does not fit: use a smaller model"):
        largest_batch_size(lambda b: False)
    with pytest.raises(ValueError, match="need 1 <= start <= limit"):
        largest_batch_size(lambda b: True, start=0)


def test_out_of_memory_means_does_not_fit_and_memory_is_released(monkeypatch):
    released = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))

    def step(batch):
        if batch > 6:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    search = largest_batch_size(cuda_step_fits(step), limit=64)
    assert search.batch_size == 6
    assert search.tried == [(1, True), (2, True), (4, True), (8, False), (6, True), (7, False)]
    assert len(released) == len(search.tried)  # the cache is emptied after every try
    with pytest.raises(ValueError):  # any other error is not "does not fit": it propagates
        cuda_step_fits(lambda b: int("x"))(1)


def test_training_step_trains_and_a_failed_step_leaves_no_gradients(monkeypatch):
    torch.manual_seed(0)
    model = GPT(TINY)
    before = model.lm_head.weight.detach().clone()
    step = make_training_step(model, seq=16)
    fits = cuda_step_fits(step)
    assert fits(2)
    assert not torch.equal(model.lm_head.weight, before)
    original = model.ln_f.forward

    def forward(x):
        if x.size(0) > 2:
            raise torch.OutOfMemoryError("simulated")
        return original(x)

    monkeypatch.setattr(model.ln_f, "forward", forward)
    assert not fits(3)
    assert all(p.grad is None for p in model.parameters())
    assert largest_batch_size(fits, limit=8).batch_size == 2


@pytest.mark.subprocess  # each peak is measured in a fresh process
@pytest.mark.serial
def test_cpu_budget_search_with_measured_peaks():
    """Real measurements: each peak is a fresh process building the model and running two training steps."""
    config = GPTConfig.from_preset("gpt-smoke")  # 64 tokens x 50257 logits: tens of MB of activations per sequence
    budget = CpuMemoryBudget(config, seq=64, budget_bytes=1 << 40)
    budget(2), budget(4)
    per_sequence = (budget.peaks[4] - budget.peaks[2]) / 2
    assert per_sequence > 3 * 64 * 50257 * 4  # at least the logits, their log-softmax and its gradient
    budget.budget_bytes = budget.peaks[2] + int(0.5 * per_sequence)  # 2 fits (measured), 4 does not
    search = largest_batch_size(budget, start=2, limit=4)
    assert search.batch_size in (2, 3) and (4, False) in search.tried
    assert all(ok == (budget.peaks[b] <= budget.budget_bytes) for b, ok in search.tried)
    assert search.tried[-1] == (3, search.batch_size == 3)
    with pytest.raises(ValueError, match="budget must be positive"):
        CpuMemoryBudget(config, 64, 0)


@pytest.mark.subprocess
@pytest.mark.serial
def test_cpu_budget_measures_checkpointing_and_the_chunked_head():
    """Per sequence, a step with block checkpointing and the LM head in chunks adds far less than a plain one: at
    gpt-smoke's size the logits dominate, and checkpointing keeps only each block's input."""
    config = GPTConfig.from_preset("gpt-smoke")
    growth = {}
    for name, kwargs in {"plain": {}, "lean": {"checkpointing": "block", "loss": ChunkedLoss(16)}}.items():
        budget = CpuMemoryBudget(config, seq=64, budget_bytes=1 << 40, **kwargs)
        budget(2), budget(6)
        growth[name] = (budget.peaks[6] - budget.peaks[2]) / 4
    assert growth["plain"] > 3 * 64 * 50257 * 4
    assert growth["lean"] < growth["plain"] / 3
    with pytest.raises(ValueError, match="unknown activation checkpointing"):
        CpuMemoryBudget(config, 64, 1 << 30, checkpointing="most")


def test_cpu_budget_sends_the_fresh_process_a_loss_it_can_rebuild():
    """The measuring process gets JSON: head_loss rebuilds the plain and chunked losses from their settings; a loss
    holding code or a model is refused before any process starts."""
    for loss in (FULL, FullLoss(vocab_size=100), ChunkedLoss(16), ChunkedLoss(16, vocab_size=100)):
        assert head_loss(**head_settings(loss)) == loss
    for loss in (FullLoss(forward=lambda model, x: model(x)), DistillationLoss(GPT(TINY))):
        with pytest.raises(ValueError, match="a fresh process rebuilds the loss from its settings"):
            CpuMemoryBudget(TINY, 32, 1 << 30, loss=loss)
