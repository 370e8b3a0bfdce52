"""Automatic batch sizing: the largest batch whose training step fits in memory.

The search (`largest_batch_size`) doubles the batch until a step does not fit, then bisects between the last
size that fit and the first that did not: about 2·log2(answer) trial steps. What "fits" means depends on
the device:

* CUDA: run the step; `torch.OutOfMemoryError` means no. The failed step's tensors are released and the
  caching allocator emptied before the next try (`cuda_step_fits`).
* CPU: running out of memory does not raise, the kernel's OOM killer ends the process. So the step's memory
  is *measured* instead, as the peak RSS a fresh process adds while building the model and optimizer and
  running two training steps (`helpers.measure.memory`), and compared with a budget (`CpuMemoryBudget`).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..model.checkpointing import check_checkpointing
from ..model.config import GPTConfig
from ..model.gpt import GPT
from ..system.device import detect_capabilities, dtype_name, parse_dtype
from ..training.precision import resolve_precision
from ..training.step import FULL, ChunkedLoss, FullLoss, Loss, TrainingStep, head_loss
from .memory import peak_cuda_bytes, peak_rss_above_baseline, run_in_fresh_process


class BatchSizeError(RuntimeError):
    """Not even the smallest batch fits."""


@dataclass
class BatchSearch:
    batch_size: int  # the largest batch that fit
    tried: list[tuple[int, bool]] = field(default_factory=list)  # (batch, fit?) in the order tried
    limit_reached: bool = False  # stopped at `limit`: larger batches may fit too


def largest_batch_size(fits: Callable[[int], bool], start: int = 1, limit: int = 1024) -> BatchSearch:
    """The largest batch in [start, limit] for which `fits(batch)` is true, assuming bigger never fits better."""
    if not 1 <= start <= limit:
        raise ValueError(f"need 1 <= start <= limit, got start={start}, limit={limit}")
    search = BatchSearch(batch_size=0)

    def probe(batch: int) -> bool:
        ok = bool(fits(batch))
        search.tried.append((batch, ok))
        return ok

    if not probe(start):
        raise BatchSizeError(f"batch size {start} does not fit: use a smaller model or context, a lower-precision "
                             "dtype, or a device with more memory")
    good, bad = start, None
    while bad is None and good < limit:  # grow geometrically until a step fails
        batch = min(2 * good, limit)
        if probe(batch):
            good = batch
        else:
            bad = batch
    while bad is not None and bad - good > 1:  # bisect between the last fit and the first failure
        batch = (good + bad) // 2
        if probe(batch):
            good = batch
        else:
            bad = batch
    search.batch_size = good
    search.limit_reached = bad is None
    return search


def make_training_step(model: GPT, seq: int, dtype: torch.dtype | None = None,
                       optimizer: torch.optim.Optimizer | None = None, loss: Loss = FULL) -> Callable[[int], None]:
    """A function running one training step (`helpers.training.step.TrainingStep`: forward, backward, AdamW) on `batch`
    random sequences; a failed step (out of memory) leaves no gradients behind. loss: the step's (ChunkedLoss: the LM
    head and loss a chunk of tokens at a time). The model's activation checkpointing stays as it is set."""
    device = next(model.parameters()).device
    step = TrainingStep(model, optimizer or torch.optim.AdamW(model.parameters(), lr=1e-4), autocast=dtype, loss=loss)
    vocab = model.config.vocab_size

    def run(batch: int) -> None:
        model.train()
        idx = torch.randint(vocab, (batch, seq + 1), device=device)
        step([(idx[:, :-1], idx[:, 1:])])

    return run


def cuda_step_fits(step: Callable[[int], None], device: torch.device | str = "cuda") -> Callable[[int], bool]:
    """fits(batch) for a GPU: try the step; out of memory means no. Memory is released after every try."""

    def fits(batch: int) -> bool:
        try:
            step(batch)
            ok = True
        except torch.OutOfMemoryError:
            ok = False  # leaving the except block drops the traceback, and with it the failed step's tensors
        gc.collect()
        torch.cuda.empty_cache()  # hand cached blocks back, so the next try starts from the same state
        return ok

    return fits


def head_settings(loss: FullLoss | ChunkedLoss) -> dict:
    """`head_loss`'s arguments that rebuild `loss` in a fresh process, which gets JSON: FullLoss or ChunkedLoss, not
    a loss holding code or models (a custom forward, a teacher)."""
    if type(loss) not in (FullLoss, ChunkedLoss) or getattr(loss, "forward", None) is not None:
        raise ValueError(f"a fresh process rebuilds the loss from its settings: use FullLoss or ChunkedLoss without a "
                         f"custom forward, got {loss!r}")
    return {"chunk": getattr(loss, "chunk", None), "vocab_size": loss.vocab_size}


def training_peak_in_fresh_process(config: dict, batch: int, seq: int, dtype: str | None = None,
                                   checkpointing: str | None = None, loss: dict | None = None) -> int:
    """Entry point of the fresh process: peak RSS (bytes) that building the model and two training steps add
    (with activation checkpointing `checkpointing`, and the loss `head_loss(**loss)`: `head_settings`)."""
    gpt_config = GPTConfig(**config)
    torch_dtype = parse_dtype(dtype) if dtype else None

    def build_and_train():
        torch.manual_seed(0)
        model = GPT(gpt_config).set_activation_checkpointing(checkpointing)
        step = make_training_step(model, seq, torch_dtype, loss=head_loss(**(loss or {})))
        step(batch)  # the first step allocates the optimizer's state
        step(batch)  # the second runs with it: the steady-state peak

    return peak_rss_above_baseline(build_and_train)


def accumulation_peak_in_fresh_process(config: dict, micro_batch: int, accum_steps: int, seq: int,
                                       device: str = "cpu", precision: str = "float32") -> int:
    """Entry point of a fresh process (helpers.measure.memory.run_in_fresh_process): the peak memory (bytes) that
    building the model and AdamW and running two optimizer steps of `accum_steps` micro-batches add.
    CUDA: peak allocated bytes; CPU: peak RSS above the process's baseline."""
    dev = torch.device(device)
    amp = resolve_precision(precision, detect_capabilities(dev.type))
    gpt_config = GPTConfig(**config)

    def build_and_train():
        torch.manual_seed(0)
        model = GPT(gpt_config).to(dev)
        step = TrainingStep(model, torch.optim.AdamW(model.parameters(), lr=1e-4), autocast=amp.dtype)
        for _ in range(2):  # the first step allocates AdamW's state, the second runs with it
            ids = torch.randint(gpt_config.vocab_size, (accum_steps, micro_batch, seq + 1), device=dev)
            step([(b[:, :-1], b[:, 1:]) for b in ids])

    if dev.type == "cuda":
        return peak_cuda_bytes(build_and_train, dev)
    return peak_rss_above_baseline(build_and_train)


class CpuMemoryBudget:
    """fits(batch) on CPU: the measured peak of model + optimizer + training step stays within `budget_bytes`.

    Every measurement runs in a fresh process (a few seconds each); `peaks` keeps them by batch size, and a
    batch size already measured is not measured again. checkpointing, loss: as `GPT.set_activation_checkpointing`
    and `TrainingStep`, for the step measured (FullLoss or ChunkedLoss: `head_settings`).
    """

    def __init__(self, config: GPTConfig, seq: int, budget_bytes: int, dtype: torch.dtype | None = None,
                 checkpointing: str | None = None, loss: FullLoss | ChunkedLoss = FULL) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the memory budget must be positive, got {budget_bytes} bytes")
        check_checkpointing(checkpointing)
        self.config, self.seq, self.budget_bytes = config, seq, budget_bytes
        self.checkpointing, self.head = checkpointing, head_settings(loss)
        self.dtype = None if dtype is None else dtype_name(dtype)
        self.peaks: dict[int, int] = {}

    def __call__(self, batch: int) -> bool:
        if batch not in self.peaks:
            self.peaks[batch] = run_in_fresh_process("helpers.measure.batch_size:training_peak_in_fresh_process",
                                                     config=dataclasses.asdict(self.config), batch=batch,
                                                     seq=self.seq, dtype=self.dtype,
                                                     checkpointing=self.checkpointing, loss=self.head)
        return self.peaks[batch] <= self.budget_bytes
