"""Pipeline parallelism: a GPT cut into consecutive stages, one per rank, and GPipe written with send/recv.

Each rank holds a contiguous slice of the layers. GPipe (Huang et al., 2019) cuts the batch into m micro-batches:
all forwards flow down the pipeline, then all backwards flow back up, and the gradients of the m micro-batches
accumulate before one optimizer step. While the pipeline fills and drains, stages wait: with p equal stages the
idle fraction (the bubble) is (p-1)/(m+p-1), so more micro-batches shrink it.

A stage is the GPT itself with the blocks of other stages (and the embeddings or the head) removed, so it runs the
model's own forward pass, and the same stages also run under `torch.distributed.pipelining` (`PipelineStage` with
`ScheduleGPipe` or `Schedule1F1B`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..model.gpt import GPT
from ..system.device import synchronize


def bubble_fraction(n_stages: int, n_microbatches: int) -> float:
    """GPipe's idle fraction with equal stages: p-1 slots of fill and drain out of m+p-1 per stage."""
    return (n_stages - 1) / (n_microbatches + n_stages - 1)


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Consecutive transformer blocks per stage, as even as possible (earlier stages get the remainder)."""
    if not 1 <= n_stages <= n_layers:
        raise ValueError(f"cannot cut {n_layers} layers into {n_stages} stages; use 1..{n_layers} stages")
    base, extra = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


def pipeline_stage(gpt: GPT, index: int, n_stages: int) -> GPT:
    """Stage `index` of `n_stages`: a copy of `gpt` keeping its own consecutive slice of blocks; the first stage also
    keeps the embeddings, the last the final LayerNorm and LM head. The GPT's forward skips what a stage lacks, so
    token ids go into the first stage, (batch, seq, d_model) activations between stages, logits come out of the
    last. With tied weights the first and last stage each hold a copy of the embedding matrix; their gradients must
    be summed (`sync_tied_gradients`), as Megatron-LM does for its pipeline.
    """
    if gpt.config.dropout:
        raise ValueError("build the GPT with dropout=0.0 to compare the pipeline with the single-process model")
    layers = stage_layers(gpt.config.n_layers, n_stages)[index]
    stage = copy.deepcopy(gpt)
    stage.blocks = nn.ModuleList(stage.blocks[i] for i in layers)  # each keeps its layer_idx
    if index > 0:
        stage.tok_emb = stage.pos_emb = None
    if index < n_stages - 1:
        stage.ln_f = stage.lm_head = None
    return stage


def is_first_stage(stage: GPT) -> bool:
    return stage.tok_emb is not None


def is_last_stage(stage: GPT) -> bool:
    return stage.lm_head is not None


def full_name(stage: GPT, name: str) -> str:
    """The single-process GPT's name for one of a stage's parameters (a stage numbers its blocks from 0)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{stage.blocks[int(i)].attn.layer_idx}.{rest}"
    if name == "lm_head.weight" and stage.config.tie_weights:
        return "tok_emb.weight"  # the GPT lists a tied weight once, under the embedding
    return name


def sync_tied_gradients(stage: GPT, group: dist.ProcessGroup | None) -> None:
    """Sum the tied embedding's gradient between the first stage (input embedding) and the last (LM head)."""
    first, last = is_first_stage(stage), is_last_stage(stage)
    if not stage.config.tie_weights or (first and last) or not (first or last):
        return
    weight = stage.tok_emb.weight if first else stage.lm_head.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    dist.all_reduce(weight.grad, group=group)


def tied_group(n_stages: int) -> dist.ProcessGroup | None:
    """The process group of the first and last stage (every rank must call this, in the same order)."""
    return dist.new_group([0, n_stages - 1]) if n_stages > 1 else None


@dataclass
class Event:
    """One compute interval of a stage: forward ("F") or backward ("B") of a micro-batch, in seconds since the
    step began (all ranks on one machine share the monotonic clock)."""

    kind: str
    micro: int
    start: float
    end: float


def gpipe_step(stage: GPT, inputs: torch.Tensor | None, targets: torch.Tensor | None, n_microbatches: int,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], activation_shape: tuple[int, ...],
               rank: int, t0: float | None = None) -> tuple[list[float], list[Event]]:
    """One GPipe step from scratch: m forwards down the pipeline, then m backwards up it; gradients accumulate.

    The first stage gets `inputs` (batch, seq) token ids, the last `targets`; `activation_shape` is one micro-
    batch's activation (micro_batch, seq, d_model), which the receiving rank needs to allocate its buffer. The
    loss of each micro-batch is divided by m, so the accumulated gradient is that of the mean loss over the whole
    batch. Returns the micro-batch losses (last stage) and the compute events of this rank, timed from `t0`.
    """
    device = next(stage.parameters()).device
    dtype = stage.blocks[0].ln1.weight.dtype
    t0 = time.perf_counter() if t0 is None else t0
    prev, nxt = rank - 1, rank + 1
    first, last = is_first_stage(stage), is_last_stage(stage)
    micro_inputs = inputs.chunk(n_microbatches) if first else [None] * n_microbatches
    micro_targets = targets.chunk(n_microbatches) if last else [None] * n_microbatches
    saved, losses, events = [], [], []

    for i in range(n_microbatches):
        if first:
            x = micro_inputs[i]
        else:
            x = torch.empty(activation_shape, device=device, dtype=dtype)
            dist.recv(x, prev)
            x.requires_grad_()
        synchronize(device)
        start = time.perf_counter() - t0
        y = stage(x)
        if last:
            y = loss_fn(y, micro_targets[i]) / n_microbatches
            losses.append(y.item() * n_microbatches)
        synchronize(device)
        events.append(Event("F", i, start, time.perf_counter() - t0))
        if not last:
            dist.send(y.detach(), nxt)
        saved.append((x, y))

    for i in reversed(range(n_microbatches)):  # GPipe drains in reverse order: the last micro-batch is ready first
        x, y = saved[i]
        grad = None
        if not last:
            grad = torch.empty_like(y)
            dist.recv(grad, nxt)
        synchronize(device)
        start = time.perf_counter() - t0
        y.backward(grad)
        synchronize(device)
        events.append(Event("B", i, start, time.perf_counter() - t0))
        if not first:
            dist.send(x.grad, prev)
        saved[i] = None  # free the micro-batch's activations as soon as its backward is done
    return losses, events


def measured_bubble(events_per_rank: list[list[Event]]) -> float:
    """Idle fraction of the step: 1 - (busy time summed over ranks) / (ranks x step length), the step running
    from the first rank's first compute to the last rank's last."""
    begin = min(e.start for events in events_per_rank for e in events)
    end = max(e.end for events in events_per_rank for e in events)
    busy = sum(e.end - e.start for events in events_per_rank for e in events)
    return 1 - busy / (len(events_per_rank) * (end - begin))
