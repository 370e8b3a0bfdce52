"""Data-parallel gradient averaging by hand, in three steps towards what DistributedDataParallel does.

Every rank holds the whole model and computes gradients on its own part of the batch; before the optimizer step
the gradients must be averaged over the ranks. Three ways, each wrapping a model and called after backward
(`finish()`):

* `PerParameterAllReduce`: one `all_reduce` per parameter, after backward: many small messages, each paying the
  collective's fixed latency, and none of them overlapping the backward pass.
* `FlatBufferAllReduce`: the gradients live in one flat buffer, so one `all_reduce` covers all of them.
* `BucketedOverlapDDP`: the flat buffer cut into buckets in the order backward produces gradients; a bucket's
  `all_reduce` is launched (asynchronously) as soon as its last gradient is accumulated, while backward goes on
  computing the earlier layers' gradients. `finish()` only waits for what is still in flight.

Each wrapper logs, per step, the all_reduce calls, the bytes handed to them and, for the overlap measurement, when
each was launched, when backward returned and when the gradients were averaged (`time.perf_counter`, the host
clock). On CUDA kernels and NCCL's all_reduce run asynchronously: the launch times are when work was queued, and
`finish()` waits for the compute stream before it reads the end of backward (the backward kernels have run; the
all_reduces on NCCL's own streams go on) and again after the gradients were averaged (waiting on a collective
orders it before the compute stream), so the two times, and the exposed communication between them, are when
the GPU got there.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .comm import tensor_bytes


@dataclass
class SyncLog:
    """One step's gradient communication as one rank saw it."""

    calls: int = 0
    bytes: int = 0
    launched: list[float] = field(default_factory=list)  # perf_counter when each all_reduce was launched
    sizes: list[int] = field(default_factory=list)  # bytes of each all_reduce, in launch order
    completed: list[float] = field(default_factory=list)  # when waiting for each one returned (async launches)
    backward_end: float | None = None  # when finish() was entered: backward had returned
    finished: float | None = None  # when finish() returned: every gradient averaged

    def record(self, tensor: torch.Tensor) -> None:
        nbytes = tensor_bytes(tensor)
        self.calls += 1
        self.bytes += nbytes
        self.sizes.append(nbytes)
        self.launched.append(time.perf_counter())

    @property
    def exposed_s(self) -> float:
        """Seconds from the end of backward until the gradients were averaged: communication nothing hid."""
        return self.finished - self.backward_end

    @property
    def launched_before_backward_end(self) -> float:
        """Fraction of the bytes whose all_reduce was launched before backward returned."""
        early = sum(n for t, n in zip(self.launched, self.sizes, strict=True) if t < self.backward_end)
        return early / self.bytes if self.bytes else 0.0


def trainable_parameters(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters to average, each once (a tied weight, as the GPT's embedding and LM head, is one tensor whose
    gradient holds both uses' contributions; `model.parameters()` yields it once, a hand-made list may not)."""
    unique = list({id(p): p for p in params if p.requires_grad}.values())
    if not unique:
        raise ValueError("no trainable parameters: pass a model (or parameters) with requires_grad=True")
    kinds = {(p.dtype, p.device) for p in unique}
    if len(kinds) > 1:
        raise ValueError(f"parameters have several dtypes/devices {sorted(map(str, kinds))}; flat buffers need one: "
                         "convert the model with .to(dtype, device) first")
    return unique


def gradient_buffer(params: list[nn.Parameter], numel: int | None = None) -> torch.Tensor:
    """A zeroed flat buffer (of `numel` elements, default the parameters' total; more pads the end), with each
    parameter's `.grad` set to its view into it. Backward then accumulates into the buffer in place: no copy in
    before the all_reduce, none out after it (DDP's gradient_as_bucket_view)."""
    total = sum(p.numel() for p in params)
    buffer = torch.zeros(total if numel is None else numel, dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = buffer[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return buffer


def check_views(params: list[nn.Parameter], buffer: torch.Tensor) -> None:
    """Fail loudly if a gradient stopped being a view of `buffer` (optimizer.zero_grad() sets them to None; the
    next backward then allocates new ones, and the buffer's all_reduce would average zeros)."""
    start, end = buffer.data_ptr(), buffer.data_ptr() + tensor_bytes(buffer)
    if any(p.grad is None or not start <= p.grad.data_ptr() < end for p in params):
        raise RuntimeError("a gradient is no longer a view of the flat buffer: clear gradients with the wrapper's "
                           "zero_grad(), not optimizer.zero_grad()")


def assign_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices (registration order) grouped into buckets, starting from the last parameter: backward
    produces gradients roughly in reverse order of registration, so the first bucket is complete first.

    A bucket never exceeds `bucket_bytes`, except a single parameter larger than that, which gets its own bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}: pass bucket_mb > 0 (DDP uses 25)")
    buckets, current, current_bytes = [], [], 0
    for i in reversed(range(len(sizes))):
        if current and current_bytes + sizes[i] > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += sizes[i]
    if current:
        buckets.append(current)
    return buckets


class GradientAverager:
    """What the three versions share: the wrapped model, rank 0's initial weights on every rank (as DDP does at
    construction), the per-step log and `no_sync`.

    A training step: `zero_grad()` (which also starts a new log), forward, `loss.backward()`, `finish()`, then the
    optimizer step. Inside `no_sync()` backward only accumulates and `finish()` does nothing, so for gradient
    accumulation the micro-batches but the last run inside it and only the last one communicates.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.params = trainable_parameters(module.parameters())
        self.world_size = dist.get_world_size()
        self.syncing = True
        self.log = SyncLog()
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, src=0)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.syncing = False
        try:
            yield
        finally:
            self.syncing = True

    def zero_grad(self) -> None:
        self.log = SyncLog()
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """Call after backward: afterwards every rank's gradients are the mean over the ranks."""
        if not self.syncing:
            return
        self.wait_for_compute()
        self.log.backward_end = time.perf_counter()
        self.average_gradients()
        self.wait_for_compute()
        self.log.finished = time.perf_counter()

    def wait_for_compute(self) -> None:
        """On CUDA, block until the current stream's queued kernels have run (not NCCL's streams); elsewhere the
        host already waited for them."""
        device = self.params[0].device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def average_gradients(self) -> None:
        raise NotImplementedError


class PerParameterAllReduce(GradientAverager):
    """One blocking all_reduce per parameter after backward (SUM, then divide: gloo has no AVG)."""

    def average_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:  # not used in this forward: contribute zeros, so every rank makes the same calls
                p.grad = torch.zeros_like(p)
            self.log.record(p.grad)
            dist.all_reduce(p.grad)
            p.grad.div_(self.world_size)


class FlatBufferAllReduce(GradientAverager):
    """One all_reduce of one flat buffer after backward. The gradients are views into that buffer, allocated once
    (`gradient_buffer`), rather than copied into it and back: no extra memory, no copies. So gradients are zeroed,
    never set to None: use this wrapper's zero_grad()."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.buffer = gradient_buffer(self.params)

    def zero_grad(self) -> None:
        self.log = SyncLog()
        self.buffer.zero_()

    def average_gradients(self) -> None:
        check_views(self.params, self.buffer)
        self.log.record(self.buffer)
        dist.all_reduce(self.buffer)
        self.buffer.div_(self.world_size)


class BucketedOverlapDDP(GradientAverager):
    """Gradients in per-bucket flat buffers (buckets of about `bucket_mb` MiB, in backward order, `assign_buckets`);
    a post-accumulate-grad hook on each parameter counts down its bucket, and a complete bucket's all_reduce is
    launched at once (async_op) while backward continues. `finish()` waits for the launched work and divides by
    the world size.

    Buckets are launched strictly in order (a bucket completed early waits for the ones before it), so every rank
    issues the same collectives in the same order whatever order its hooks fire in. A tied weight has one
    gradient accumulator, whose hook fires once per backward, after both uses' contributions are summed.
    With `overlap=False` no hooks act and `finish()` all-reduces the same buckets one by one after backward,
    blocking: the communication time that overlapping can hide.
    """

    def __init__(self, module: nn.Module, bucket_mb: float = 25.0, overlap: bool = True):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}: pass the bucket size in MiB (DDP uses 25)")
        super().__init__(module)
        self.overlap = overlap
        element = self.params[0].element_size()
        self.buckets = [[self.params[i] for i in b]
                        for b in assign_buckets([p.numel() * element for p in self.params], int(bucket_mb * 2**20))]
        self.buffers = [gradient_buffer(bucket) for bucket in self.buckets]
        self.reset_pending()
        if overlap:
            for index, bucket in enumerate(self.buckets):
                for p in bucket:
                    p.register_post_accumulate_grad_hook(lambda _, index=index: self.gradient_ready(index))

    def reset_pending(self) -> None:
        self.pending = [len(bucket) for bucket in self.buckets]  # gradients each bucket still waits for
        self.next_bucket = 0  # the first bucket not launched yet
        self.works: list[dist.Work] = []

    def zero_grad(self) -> None:
        self.log = SyncLog()
        for buffer in self.buffers:
            buffer.zero_()

    def gradient_ready(self, index: int) -> None:
        if not self.syncing:
            return
        self.pending[index] -= 1
        while self.next_bucket < len(self.buckets) and self.pending[self.next_bucket] == 0:
            self.launch(self.next_bucket)

    def launch(self, index: int) -> None:
        self.log.record(self.buffers[index])
        self.works.append(dist.all_reduce(self.buffers[index], async_op=True))
        self.next_bucket = index + 1

    def average_gradients(self) -> None:
        for params, buffer in zip(self.buckets, self.buffers, strict=True):
            check_views(params, buffer)
        if not self.overlap:
            for buffer in self.buffers:
                self.log.record(buffer)
                dist.all_reduce(buffer)
        else:
            while self.next_bucket < len(self.buckets):  # buckets with a parameter unused in this forward
                self.launch(self.next_bucket)
            for work in self.works:
                work.wait()
                self.wait_for_compute()  # on CUDA wait() only orders the all_reduce before the compute stream
                self.log.completed.append(time.perf_counter())
        for buffer in self.buffers:
            buffer.div_(self.world_size)
        self.reset_pending()
