"""Megatron-style tensor parallelism from scratch, and the same split with `torch.distributed.tensor.parallel`.

Tensor parallelism splits each layer's weights across ranks (DDP, by contrast, copies the whole model to every
rank). Megatron-LM (Shoeybi et al., 2019) pairs a column-parallel linear layer (each rank owns some output
features) with a row-parallel one (each rank owns the matching input features), so the activation between them
never needs to be gathered:

* attention: the fused QKV projection is column-parallel (each rank computes its own heads), the output
  projection row-parallel;
* MLP: the first linear is column-parallel (each rank a slice of the hidden units), the second row-parallel.

Two conjugate operators carry the communication (Megatron's f and g): `copy_to_parallel` is the identity in
forward and an all-reduce of the input gradient in backward; `reduce_from_parallel` all-reduces the partial
outputs in forward and is the identity in backward. Per attention or MLP block: one all-reduce of a
(batch, seq, d_model) activation in forward, one in backward.

The layers are built from a `helpers.GPT`'s own modules: each rank takes its shard of the weights, so outputs and
gradients can be compared with the single-process model.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .attention import CausalSelfAttention
from .distributed import CommLog, tensor_bytes
from .model import GPT, FeedForward, SwiGLUFeedForward, TransformerBlock


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


class TensorParallelAttention(nn.Module):
    """Causal self-attention with this rank's heads: QKV column-parallel, output projection row-parallel."""

    def __init__(self, attn: CausalSelfAttention, rank: int, world_size: int, logs: TPLogs | None = None):
        super().__init__()
        if attn.n_heads % world_size:
            raise ValueError(f"{attn.n_heads} attention heads cannot be split over {world_size} ranks; "
                             "use a tensor-parallel degree that divides n_heads")
        if attn.attn_dropout:
            raise ValueError("tensor-parallel attention here has no dropout (each rank would need the same "
                             "random mask for the replicated parts); build the GPT with dropout=0.0")
        self.n_heads, self.head_dim = attn.n_heads // world_size, attn.head_dim
        self.qkv = ColumnParallelLinear(attn.qkv, rank, world_size, parts=3, logs=logs)
        self.out_proj = RowParallelLinear(attn.out_proj, rank, world_size, logs=logs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (t.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class TensorParallelMLP(nn.Module):
    """The feed-forward with this rank's hidden units: first linear column-parallel, second row-parallel."""

    def __init__(self, mlp: FeedForward | SwiGLUFeedForward, rank: int, world_size: int, logs: TPLogs | None = None):
        super().__init__()
        if mlp.dropout.p:
            raise ValueError("build the GPT with dropout=0.0 for tensor parallelism")
        self.gated = isinstance(mlp, SwiGLUFeedForward)
        self.fc = ColumnParallelLinear(mlp.fc, rank, world_size, parts=2 if self.gated else 1, logs=logs)
        self.proj = RowParallelLinear(mlp.proj, rank, world_size, logs=logs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.proj(h)


class TensorParallelBlock(nn.Module):
    """A pre-LayerNorm block whose attention and MLP are split; the LayerNorms are replicated on every rank."""

    def __init__(self, block: TransformerBlock, rank: int, world_size: int, logs: TPLogs | None = None):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = TensorParallelAttention(block.attn, rank, world_size, logs)
        self.mlp = TensorParallelMLP(block.mlp, rank, world_size, logs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """A `helpers.GPT` with every block tensor-parallel; embeddings, final LayerNorm and LM head replicated.

    Replicated parameters see the same inputs and (after f's all-reduce) the same gradients on every rank, so
    they stay equal without any extra communication.
    """

    def __init__(self, gpt: GPT, rank: int, world_size: int, logs: TPLogs | None = None):
        super().__init__()
        self.logs = logs
        # One deepcopy of the replicated parts keeps the LM head tied to the token embedding.
        self.tok_emb, self.pos_emb, self.ln_f, self.lm_head = copy.deepcopy(
            (gpt.tok_emb, gpt.pos_emb, gpt.ln_f, gpt.lm_head))
        self.blocks = nn.ModuleList(TensorParallelBlock(b, rank, world_size, logs) for b in gpt.blocks)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def shard_of(tp_model: TensorParallelGPT, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the full-size tensor `full` (a parameter or gradient of the single-process GPT called `name`)
    that the tensor-parallel parameter of the same name holds on this rank."""
    module_name, _, _ = name.rpartition(".")
    module = tp_model.get_submodule(module_name)
    return module.shard(full) if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) else full


# ---- the same split with PyTorch's DTensor-based tensor parallelism ----


def parallelize_gpt(gpt: GPT, mesh) -> dict[str, torch.Tensor]:
    """Split a (copied) `helpers.GPT` in place with `parallelize_module`: ColwiseParallel for QKV and the MLP's
    first linear, RowwiseParallel for the two output projections.

    ColwiseParallel shards a weight's rows contiguously, which would give rank 0 all of Q and half of K. So the
    fused layers' rows are first permuted into rank order ([Q_0 K_0 V_0 | Q_1 K_1 V_1 ...]), and each attention
    module is told it now computes n_heads / world heads. Returns the row permutation applied to each fused
    weight, by parameter name, to map gradients back.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = mesh.size()
    permutations = {}
    for i, block in enumerate(gpt.blocks):
        attn, mlp = block.attn, block.mlp
        if attn.n_heads % world:
            raise ValueError(f"{attn.n_heads} heads cannot be split over {world} ranks")
        fused = [("attn.qkv", attn.qkv, 3), ("mlp.fc", mlp.fc, 2 if isinstance(mlp, SwiGLUFeedForward) else 1)]
        for name, linear, parts in fused:
            perm = torch.cat([shard_rows(linear.out_features, parts, r, world) for r in range(world)])
            with torch.no_grad():
                linear.weight.copy_(linear.weight[perm])
                if linear.bias is not None:
                    linear.bias.copy_(linear.bias[perm])
            permutations[f"blocks.{i}.{name}.weight"] = permutations[f"blocks.{i}.{name}.bias"] = perm
        parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        attn.n_heads //= world
        attn.d_model //= world
    return permutations
