"""Activation checkpointing: keep fewer of a block's activations for the backward and recompute the rest.

A training step keeps, for every block, the tensors its backward needs: about 16 x d_model values per token in a
GPT-2 block (the norms' outputs, the query/key/value projection, attention's output, the MLP's 4d-wide input and
GELU output, ...), plus attention's own. Two ways to keep less:

* "block": keep only each block's input; the backward runs the block's forward again to rebuild the rest. Memory
  for activations falls to d_model values per token per block (plus one block's worth while it is recomputed);
  the price is a second forward of every block, about a third more compute per step.
* "selective": keep what is expensive to recompute and cheap to store — the outputs of the matmuls and of
  attention, whose FLOPs are the block's — and recompute the rest: norms, GELU, residual adds, dropout, dtype
  casts, which are elementwise. It keeps more than "block" and recomputes almost no FLOPs.

Both give the same gradients as keeping everything (dropout's random numbers are replayed; a test checks it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("block", "selective")

aten = torch.ops.aten
# the ops whose outputs "selective" keeps: matmuls (linear layers, textbook attention) and fused attention kernels
EXPENSIVE_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
})


def check_checkpointing(mode: str | None) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown activation checkpointing {mode!r}; use one of {', '.join(MODES)}, or None")


def keep_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep the outputs of matmuls and attention, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                 mode: str) -> torch.Tensor:
    """block(x) under activation checkpointing `mode` (one of MODES)."""
    context_fn = None
    if mode == "selective":
        context_fn = functools.partial(create_selective_checkpoint_contexts, keep_expensive)
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(block, x, None, rope, use_reentrant=False, **kwargs)
