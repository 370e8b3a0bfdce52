"""Megatron-style tensor parallelism from scratch, and the same split with `torch.distributed.tensor.parallel`.

Tensor parallelism splits each layer's weights across ranks (DDP, by contrast, copies the whole model to every
rank). Megatron-LM (Shoeybi et al., 2019) pairs a column-parallel linear layer (each rank owns some output
features) with a row-parallel one (each rank owns the matching input features), so the activation between them
never needs to be gathered:

* attention: the fused QKV projection is column-parallel (each rank computes its own heads), the output
  projection row-parallel;
* MLP: the first linear is column-parallel (each rank a slice of the hidden units), the second row-parallel; each
  feed-forward type declares its layers' splits (`helpers.model.feed_forward.FeedForwardPart.tensor_parallel`).

Two conjugate operators carry the communication (Megatron's f and g): `copy_to_parallel` is the identity in
forward and an all-reduce of the input gradient in backward; `reduce_from_parallel` all-reduces the partial
outputs in forward and is the identity in backward. Per attention or MLP block: one all-reduce of a
(batch, seq, d_model) activation in forward, one in backward.

`tensor_parallel_gpt` swaps a `helpers.GPT`'s own Linear layers for these (each rank takes its shard of the
weights), so the model's forward pass runs unchanged and outputs and gradients can be compared with the
single-process model; `parallelize_gpt` does the same with PyTorch's DTensor-based tensor parallelism.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..model.attention import AttentionCall, unavailable_reason
from ..model.feed_forward import Split
from ..model.gpt import GPT
from .comm import CommLog, tensor_bytes


def shard_rows(out_features: int, parts: int, rank: int, world_size: int) -> torch.Tensor:
    """Indices of the output features rank `rank` owns in a column-parallel layer.

    A fused layer stacks `parts` blocks (QKV: 3, SwiGLU's gate and up: 2); each rank takes its slice of every
    block, so it holds the Q, K and V rows of the same heads, not the first third of the fused matrix.
    """
    if out_features % parts or (out_features // parts) % world_size:
        raise ValueError(f"{out_features} output features in {parts} part(s) cannot be split evenly over "
                         f"{world_size} ranks; choose sizes divisible by the tensor-parallel degree")
    block, shard = out_features // parts, out_features // parts // world_size
    return torch.cat([torch.arange(p * block + rank * shard, p * block + (rank + 1) * shard) for p in range(parts)])


class _CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input gradient over ranks (each rank's shard of the
    next layer contributed a part of it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: CommLog | None) -> torch.Tensor:
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        if ctx.log is not None:
            ctx.log.calls, ctx.log.bytes = ctx.log.calls + 1, ctx.log.bytes + tensor_bytes(grad)
        dist.all_reduce(grad)
        return grad, None


class _ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over ranks; identity backward (the output is replicated)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, log: CommLog | None) -> torch.Tensor:
        x = x.contiguous()
        if log is not None:
            log.calls, log.bytes = log.calls + 1, log.bytes + tensor_bytes(x)
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class TPLogs:
    """All-reduce calls and bytes of the forward (g) and backward (f) operators, kept apart."""

    def __init__(self) -> None:
        self.forward, self.backward = CommLog(), CommLog()

    def reset(self) -> None:
        self.forward.reset()
        self.backward.reset()


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's output features; the input is replicated (f before it)."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, parts: int = 1, logs: TPLogs | None = None):
        super().__init__()
        self.register_buffer("rows", shard_rows(full.out_features, parts, rank, world_size), persistent=False)
        self.weight = nn.Parameter(full.weight.detach()[self.rows].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[self.rows].clone())
        self.logs = logs

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full-size weight or bias (or of its gradient)."""
        return full[self.rows.to(full.device)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToParallel.apply(x, self.logs.backward if self.logs else None)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local W_local^T, then + b: the input arrives split (from a column-parallel layer),
    the partial products are all-reduced (g), the bias is added once, after the sum."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, logs: TPLogs | None = None):
        super().__init__()
        if full.in_features % world_size:
            raise ValueError(f"{full.in_features} input features cannot be split over {world_size} ranks")
        shard = full.in_features // world_size
        self.cols = slice(rank * shard, (rank + 1) * shard)
        self.weight = nn.Parameter(full.weight.detach()[:, self.cols].clone())
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())  # replicated
        self.logs = logs

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        return full[:, self.cols] if full.dim() == 2 else full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromParallel.apply(F.linear(x, self.weight), self.logs.forward if self.logs else None)
        return y if self.bias is None else y + self.bias


def check_tensor_parallel(gpt: GPT, world_size: int) -> None:
    """Refuse what a tensor-parallel split of `gpt` cannot do, saying what to change."""
    if gpt.config.n_heads % world_size:
        raise ValueError(f"{gpt.config.n_heads} attention heads cannot be split over {world_size} ranks; use a "
                         "tensor-parallel degree that divides n_heads")
    if gpt.config.kv_heads != gpt.config.n_heads:
        raise ValueError(f"this split cuts the fused QKV rows into three equal parts, but with grouped-query attention "
                         f"(n_kv_heads={gpt.config.kv_heads}) K and V are narrower than Q; use n_kv_heads=None")
    if gpt.config.dropout:
        raise ValueError("build the GPT with dropout=0.0 for tensor parallelism (each rank would need the same "
                         "random mask for the replicated parts)")
    reason = unavailable_reason(gpt.attn_implementation, AttentionCall("cpu", torch.float32, sharded=True))
    if reason is not None:
        raise ValueError(f"attn_implementation={gpt.attn_implementation!r}: {reason}")


ATTENTION_SPLITS = {"qkv": Split("column", parts=3), "out_proj": Split("row")}  # each rank: its heads' Q, K and V


def layer_splits(block: nn.Module) -> dict[str, Split]:
    """How each Linear layer of a transformer block splits, by its name in the block (`attn.qkv`, `mlp.fc`, ...)."""
    splits = {f"attn.{name}": split for name, split in ATTENTION_SPLITS.items()}
    return splits | {f"mlp.{name}": split for name, split in type(block.mlp).tensor_parallel.items()}


def tensor_parallel_gpt(gpt: GPT, rank: int, world_size: int, logs: TPLogs | None = None) -> GPT:
    """A copy of `gpt` split Megatron-style: in every block the model's own QKV projection and the feed-forward's
    column layers (its first, for GPT-2's MLP) become column-parallel, the output projections row-parallel, and the
    attention computes this rank's heads. The model's forward pass runs unchanged, with its own attention
    implementation and feed-forward (whichever registered type, by the splits it declares).

    Embeddings, norms and the LM head stay replicated: they see the same inputs and (after f's all-reduce) the
    same gradients on every rank, so they stay equal without any extra communication.
    """
    check_tensor_parallel(gpt, world_size)
    model = copy.deepcopy(gpt)  # one copy keeps the LM head tied to the token embedding
    for block in model.blocks:
        for name, split in layer_splits(block).items():
            owner, _, attribute = name.rpartition(".")
            full = block.get_submodule(name)
            parallel = (ColumnParallelLinear(full, rank, world_size, split.parts, logs) if split.kind == "column"
                        else RowParallelLinear(full, rank, world_size, logs))
            setattr(block.get_submodule(owner), attribute, parallel)
        block.attn.n_heads //= world_size
        block.attn.n_kv_heads //= world_size
    return model


def shard_of(tp_model: GPT, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the full-size tensor `full` (a parameter or gradient of the single-process GPT called `name`)
    that the tensor-parallel parameter of the same name holds on this rank."""
    module_name, _, _ = name.rpartition(".")
    module = tp_model.get_submodule(module_name)
    return module.shard(full) if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) else full


# ---- the same split with PyTorch's DTensor-based tensor parallelism ----


def parallelize_gpt(gpt: GPT, mesh) -> dict[str, torch.Tensor]:
    """Split a (copied) `helpers.GPT` in place with `parallelize_module`: ColwiseParallel for the column layers
    (QKV, the feed-forward's first), RowwiseParallel for the row ones (the output projections): `layer_splits`.

    ColwiseParallel shards a weight's rows contiguously, which would give rank 0 all of Q and half of K. So the
    fused layers' rows are first permuted into rank order ([Q_0 K_0 V_0 | Q_1 K_1 V_1 ...]), and each attention
    module is told it now computes n_heads / world heads (and as many key/value heads). Returns the row permutation
    applied to each fused weight, by parameter name, to map gradients back.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = mesh.size()
    check_tensor_parallel(gpt, world)
    permutations = {}
    for i, block in enumerate(gpt.blocks):
        splits = layer_splits(block)
        for name, split in splits.items():
            if split.kind != "column":
                continue
            linear = block.get_submodule(name)
            perm = torch.cat([shard_rows(linear.out_features, split.parts, r, world) for r in range(world)])
            with torch.no_grad():
                linear.weight.copy_(linear.weight[perm])
                if linear.bias is not None:
                    linear.bias.copy_(linear.bias[perm])
            permutations[f"blocks.{i}.{name}.weight"] = permutations[f"blocks.{i}.{name}.bias"] = perm
        parallelize_module(block, mesh, {name: ColwiseParallel() if split.kind == "column" else RowwiseParallel()
                                         for name, split in splits.items()})
        block.attn.n_heads //= world
        block.attn.n_kv_heads //= world
    return permutations
