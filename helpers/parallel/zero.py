"""ZeRO stage 1 by hand: AdamW whose state (the two moments, 8 bytes per fp32 parameter) is sharded over the ranks.

With DDP every rank keeps AdamW's moments for every parameter, twice the model's bytes on each rank. ZeRO-1
(Rajbhandari et al., 2020) flattens the parameters into one buffer and gives rank r the r-th contiguous 1/p of it:
rank r keeps the moments of that shard only, and updates only that shard. A step is

1. reduce-scatter the flat gradient: rank r receives the sum of its shard over the ranks (then / p for the mean);
2. AdamW on the shard (torch.optim.AdamW applied to the shard tensor: AdamW is elementwise, so updating a
   flat slice is the same as updating the parameters it covers);
3. all-gather the updated shards into the flat parameter buffer, which the model's parameters are views of.

Both collectives work on gloo (CPU) and NCCL. On gloo the reduce-scatter sends as much as an all-reduce of the
whole buffer (notebook 04 measures it); NCCL's ring sends (p-1)/p of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .comm import tensor_bytes
from .data_parallel import gradient_buffer, trainable_parameters

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names warn); older
# releases have only the old names
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s shard of a flat buffer of `numel` elements: ceil(numel / p) elements each,
    contiguous; the buffer is padded to p shards, so the last rank's shard may end in (fewer than p) padding."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..world_size-1 and world_size >= 1, got rank {rank}, world {world_size}")
    if numel < world_size:
        raise ValueError(f"{numel} elements cannot be sharded over {world_size} ranks: pass at least one per rank")
    shard = math.ceil(numel / world_size)
    return rank * shard, (rank + 1) * shard


def adam_moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of an Adam/AdamW optimizer's moments (exp_avg, exp_avg_sq); the scalar step counters are left out."""
    return sum(tensor_bytes(state[k]) for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
               if k in state)


class ZeroRedundancyAdamW:
    """AdamW with ZeRO-1 sharding of its state over the default process group.

    Construction broadcasts rank 0's parameters and turns every parameter and gradient into a view of a flat
    buffer (padded to p equal shards); clear gradients with this object's `zero_grad()`, which zeroes the buffer.
    Weight decay applies to every parameter alike, as with `torch.optim.AdamW(model.parameters(), ...)`.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        self.params = trainable_parameters(params)
        self.world_size, rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.start, self.stop = shard_range(self.numel, self.world_size, rank)
        padded = (self.stop - self.start) * self.world_size
        with torch.no_grad():
            self.flat_params = torch.zeros(padded, dtype=self.params[0].dtype, device=self.params[0].device)
            offset = 0
            for p in self.params:
                view = self.flat_params[offset : offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the model now computes with the flat buffer's memory
                offset += p.numel()
            dist.broadcast(self.flat_params, src=0)
        self.flat_grads = gradient_buffer(self.params, padded)
        self.shard = self.flat_params[self.start : self.stop]  # a leaf view: AdamW updates the buffer in place
        self.shard.grad = torch.zeros_like(self.shard)  # where the reduce-scatter puts this rank's summed gradient
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    @torch.no_grad()
    def step(self) -> None:
        reduce_scatter(self.shard.grad, self.flat_grads)
        self.shard.grad.div_(self.world_size)
        self.optimizer.step()
        # In place: this rank's input is already its slice of the output (NCCL documents this case; gloo copies).
        all_gather(self.flat_params, self.shard)

    def state_bytes(self) -> int:
        """AdamW moment bytes this rank holds: 2 x its shard."""
        return adam_moment_bytes(self.optimizer)
