"""Pipeline parallelism: a GPT cut into consecutive stages, one per rank, and GPipe written with send/recv.

Each rank holds a contiguous slice of the layers. GPipe (Huang et al., 2019) cuts the batch into m micro-batches:
all forwards flow down the pipeline, then all backwards flow back up, and the gradients of the m micro-batches
accumulate before one optimizer step. While the pipeline fills and drains, stages wait: with p equal stages the
idle fraction (the bubble) is (p-1)/(m+p-1), so more micro-batches shrink it.

The stage modules built here are plain `nn.Module`s, so the same stages also run under
`torch.distributed.pipelining` (`PipelineStage` with `ScheduleGPipe` or `Schedule1F1B`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .model import GPT


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


class GPTStage(nn.Module):
    """Stage `index` of `n_stages`: the first adds the embeddings, the last the final LayerNorm and LM head.

    Token ids go into the first stage, (batch, seq, d_model) activations between stages, logits come out of the
    last. With tied weights the first and last stage each hold a copy of the embedding matrix; their gradients
    must be summed (`sync_tied_gradients`), as Megatron-LM does for its pipeline.
    """

    def __init__(self, gpt: GPT, index: int, n_stages: int):
        super().__init__()
        if gpt.config.dropout:
            raise ValueError("build the GPT with dropout=0.0 to compare the pipeline with the single-process model")
        self.index, self.n_stages = index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.layers = stage_layers(gpt.config.n_layers, n_stages)[index]
        self.tok_emb = copy.deepcopy(gpt.tok_emb) if self.is_first else None
        self.pos_emb = copy.deepcopy(gpt.pos_emb) if self.is_first else None
        self.blocks = nn.ModuleList(copy.deepcopy(gpt.blocks[i]) for i in self.layers)
        self.ln_f = copy.deepcopy(gpt.ln_f) if self.is_last else None
        self.lm_head = None
        if self.is_last:
            self.lm_head = nn.Linear(gpt.config.d_model, gpt.config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(gpt.lm_head.weight.detach().clone())
        self.tied = gpt.config.tie_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x

    def full_name(self, name: str) -> str:
        """The single-process GPT's name for one of this stage's parameters (blocks are renumbered here)."""
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            return f"blocks.{self.layers[int(i)]}.{rest}"
        if name == "lm_head.weight" and self.tied:
            return "tok_emb.weight"  # the GPT lists a tied weight once, under the embedding
        return name


def sync_tied_gradients(stage: GPTStage, group: dist.ProcessGroup | None) -> None:
    """Sum the tied embedding's gradient between the first stage (input embedding) and the last (LM head)."""
    if not stage.tied or stage.n_stages == 1 or not (stage.is_first or stage.is_last):
        return
    weight = stage.tok_emb.weight if stage.is_first else stage.lm_head.weight
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


def gpipe_step(stage: GPTStage, inputs: torch.Tensor | None, targets: torch.Tensor | None, n_microbatches: int,
               loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], activation_shape: tuple[int, ...],
               rank: int, t0: float | None = None) -> tuple[list[float], list[Event]]:
    """One GPipe step from scratch: m forwards down the pipeline, then m backwards up it; gradients accumulate.

    The first stage gets `inputs` (batch, seq) token ids, the last `targets`; `activation_shape` is one micro-
    batch's activation (micro_batch, seq, d_model), which the receiving rank needs to allocate its buffer. The
    loss of each micro-batch is divided by m, so the accumulated gradient is that of the mean loss over the whole
    batch. Returns the micro-batch losses (last stage) and the compute events of this rank, timed from `t0`.
    """
    device = stage.blocks[0].ln1.weight.device if len(stage.blocks) else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter() if t0 is None else t0
    prev, nxt = rank - 1, rank + 1
    micro_inputs = inputs.chunk(n_microbatches) if stage.is_first else [None] * n_microbatches
    micro_targets = targets.chunk(n_microbatches) if stage.is_last else [None] * n_microbatches
    saved, losses, events = [], [], []

    for i in range(n_microbatches):
        if stage.is_first:
            x = micro_inputs[i]
        else:
            x = torch.empty(activation_shape, device=device)
            dist.recv(x, prev)
            x.requires_grad_()
        sync()
        start = time.perf_counter() - t0
        y = stage(x)
        if stage.is_last:
            y = loss_fn(y, micro_targets[i]) / n_microbatches
            losses.append(y.item() * n_microbatches)
        sync()
        events.append(Event("F", i, start, time.perf_counter() - t0))
        if not stage.is_last:
            dist.send(y.detach(), nxt)
        saved.append((x, y))

    for i in reversed(range(n_microbatches)):  # GPipe drains in reverse order: the last micro-batch is ready first
        x, y = saved[i]
        grad = None
        if not stage.is_last:
            grad = torch.empty_like(y)
            dist.recv(grad, nxt)
        sync()
        start = time.perf_counter() - t0
        y.backward(grad)
        sync()
        events.append(Event("B", i, start, time.perf_counter() - t0))
        if not stage.is_first:
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
