"""Expert parallelism: each rank holds n_experts / world of a Mixture-of-Experts layer's experts, and the tokens
travel to the experts (GShard, Switch Transformer, DeepSeek-V3).

Outside the experts the model is data parallel: every rank holds the rest of it (attention, the router, a shared
expert) and runs its own part of the batch. In each MoE layer a rank routes its own tokens with the full router,
then sends every token slot (a token and one of its k experts) to the rank that owns the expert:

1. an all-to-all of the counts: how many slots for each expert go to each rank (so each rank knows what it will
   receive, and for which of its experts);
2. an all-to-all of the slots' hidden vectors, sorted by expert, so each destination's slots are one block;
3. each rank runs its experts on the slots it received;
4. an all-to-all back with the experts' outputs, which each rank weights by the router and sums per token.

Steps 2 and 4 are one autograd Function whose backward is the same exchange reversed: the gradient of every
received row goes back to the rank that sent it. So the experts' gradients sum over every rank's tokens, and the
router's and the shared expert's gradients are each rank's own, to be averaged over the ranks as DDP would
(`average_gradients`).

Per MoE layer and rank the forward pass sends the slots whose expert lives elsewhere and the outputs of the slots
received from elsewhere (plus the counts); the backward pass sends as many gradient rows back
(`exchange_bytes`). gloo runs `all_to_all_single` with uneven splits, so no padding is needed.

A capacity factor is refused: it limits an expert's slots per batch, and each rank would count its own part of
the batch instead of the whole batch one process sees.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..model.feed_forward import silu_gate
from ..model.gpt import GPT
from ..model.moe import MoEFeedForward, grouped_linear, route
from .comm import CommLog, tensor_bytes

COUNT_BYTES = torch.empty((), dtype=torch.int64).element_size()  # the counts travel as int64


def experts_owned(n_experts: int, rank: int, world_size: int) -> range:
    """The experts rank `rank` holds: a contiguous block of n_experts / world_size, so an expert's owner is its id
    divided by the block size and slots sorted by expert are also sorted by owner."""
    if n_experts % world_size:
        raise ValueError(f"{n_experts} experts cannot be split evenly over {world_size} ranks; choose n_experts "
                         "divisible by the expert-parallel degree")
    block = n_experts // world_size
    return range(rank * block, (rank + 1) * block)


def slots_between_ranks(experts_by_rank: Sequence[torch.Tensor], n_experts: int) -> torch.Tensor:
    """(world, world) matrix: entry [s, d] counts the token slots of rank s's tokens whose expert rank d owns.
    `experts_by_rank[s]` holds rank s's chosen experts, (tokens, k)."""
    world = len(experts_by_rank)
    block = len(experts_owned(n_experts, 0, world))
    return torch.stack([torch.bincount(e.flatten().cpu() // block, minlength=world) for e in experts_by_rank])


def exchange_bytes(experts_by_rank: Sequence[torch.Tensor], n_experts: int, row_bytes: int) -> list[dict[str, int]]:
    """Bytes each rank sends to other ranks in one MoE layer, forward and backward, for this routing.

    Forward: the counts (its slots for each expert another rank owns), the hidden vectors of its slots whose expert
    lives elsewhere, and the outputs of the slots it received from elsewhere. Backward: the same rows reversed (the
    outputs' gradients to the experts' ranks, the inputs' gradients back to the tokens' ranks). `row_bytes`: one
    hidden vector, d_model x element size. A rank's slots for its own experts never leave it.
    """
    matrix = slots_between_ranks(experts_by_rank, n_experts)
    away = matrix - torch.diag(torch.diagonal(matrix))
    world = len(experts_by_rank)
    counts = (n_experts - n_experts // world) * COUNT_BYTES
    rows = (away.sum(1) + away.sum(0)).tolist()  # sent away, and received from away (returned)
    return [{"forward": counts + n * row_bytes, "backward": n * row_bytes} for n in rows]


@dataclass
class EPLogs:
    """The all-to-all exchanges of the forward passes and of the backward passes, kept apart. In each CommLog,
    `bytes` is what a rank handed to all_to_all (its own slots included), `bytes_sent` what went to other ranks."""

    forward: CommLog = field(default_factory=CommLog)
    backward: CommLog = field(default_factory=CommLog)

    def reset(self) -> None:
        self.forward.reset()
        self.backward.reset()


def all_to_all(x: torch.Tensor, send: list[int], receive: list[int], log: CommLog | None) -> torch.Tensor:
    """Rows x[the send[0] first] to rank 0, the next send[1] to rank 1, ...; returns the rows received, receive[r]
    from rank r, in rank order."""
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, receive, send)
    if log is not None:
        row = tensor_bytes(x[:1]) if len(x) else 0
        log.calls += 1
        log.bytes += tensor_bytes(x)
        log.bytes_sent += row * (sum(send) - send[dist.get_rank()])
    return out


class _ExchangeRows(torch.autograd.Function):
    """`all_to_all` of rows, differentiable: the backward sends each row's gradient back where the row came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int], logs: EPLogs | None) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.logs = send, receive, logs
        return all_to_all(x, send, receive, logs.forward if logs else None)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all(grad, ctx.receive, ctx.send, ctx.logs.backward if ctx.logs else None), None, None, None


class ExpertParallelMoE(nn.Module):
    """A `MoEFeedForward` whose experts are spread over the ranks: this rank's block of `gate_up` and `down`, the
    router (and router bias, shared expert) replicated. The same call, x (..., d_model) -> (..., d_model), on this
    rank's tokens; `routing` keeps the last training pass's routing of them."""

    def __init__(self, full: MoEFeedForward, rank: int, world_size: int, logs: EPLogs | None = None) -> None:
        super().__init__()
        if full.capacity_factor is not None:
            raise ValueError("expert parallelism here takes capacity_factor=None: a capacity counted on each rank's "
                             "part of the batch is not the capacity one process counts on the whole batch")
        self.n_experts = full.gate_up.size(0)
        self.owned = experts_owned(self.n_experts, rank, world_size)
        self.rank, self.world_size, self.logs = rank, world_size, logs
        self.k, self.order = full.k, full.order
        self.router = copy.deepcopy(full.router)
        self.register_buffer("router_bias", full.router_bias.detach().clone())
        own = slice(self.owned.start, self.owned.stop)
        self.gate_up = nn.Parameter(full.gate_up.detach()[own].clone())
        self.down = nn.Parameter(full.down.detach()[own].clone())
        self.shared = copy.deepcopy(full.shared)
        self.dropout = copy.deepcopy(full.dropout)
        self.routing = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        routing = route(self.router(flat), self.k, self.order, self.router_bias)
        if self.training:
            self.routing = routing
        token, expert, weight = MoEFeedForward.slots(routing)
        by_expert = torch.argsort(expert, stable=True)  # by expert, hence by owner: one block per destination
        token, expert, weight = token[by_expert], expert[by_expert], weight[by_expert]
        per_expert = torch.bincount(expert, minlength=self.n_experts)
        received = self.exchange_counts(per_expert)  # (world, local experts): slots from each rank, per expert
        send = per_expert.view(self.world_size, -1).sum(1).tolist()
        receive = received.sum(1).tolist()
        rows = _ExchangeRows.apply(flat[token], send, receive, self.logs)
        outputs = _ExchangeRows.apply(self.run_experts(rows, received), receive, send, self.logs)
        out = torch.zeros_like(flat, dtype=torch.promote_types(flat.dtype, weight.dtype))
        out = self.dropout(out.index_add(0, token, (outputs * weight[:, None].to(outputs.dtype)).to(out.dtype))
                           .to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)  # (with its own dropout)
        return out.view_as(x)

    def global_load(self) -> torch.Tensor:
        """Token slots each expert got in the last training pass, over every rank's tokens: the load the replicated
        balancing bias must follow (each rank's own would move the replicas apart)."""
        load = self.routing.load.clone()
        dist.all_reduce(load)
        return load

    def exchange_counts(self, per_expert: torch.Tensor) -> torch.Tensor:
        """Every rank's slot count for each of this rank's experts, (world, local experts), from this rank's counts
        for every expert: one all-to-all of n_experts integers."""
        received = all_to_all(per_expert, [len(self.owned)] * self.world_size, [len(self.owned)] * self.world_size,
                              self.logs.forward if self.logs else None)
        return received.view(self.world_size, len(self.owned))

    def run_experts(self, rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        """The local experts on the received rows (grouped by sender, then by expert), in the order received."""
        local = torch.arange(len(self.owned), device=rows.device).repeat(self.world_size)
        expert = local.repeat_interleave(received.flatten().to(rows.device))
        by_expert = torch.argsort(expert, stable=True)
        ends = torch.bincount(expert, minlength=len(self.owned)).cumsum(0)
        hidden = silu_gate(*grouped_linear(rows[by_expert], self.gate_up, ends).chunk(2, dim=-1))
        return grouped_linear(hidden, self.down, ends)[torch.argsort(by_expert)]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a full-size `gate_up` or `down` (or of its gradient)."""
        return full[self.owned.start:self.owned.stop]


def expert_parallel_gpt(gpt: GPT, rank: int, world_size: int, logs: EPLogs | None = None) -> GPT:
    """A copy of `gpt` whose MoE feed-forwards keep only this rank's experts and exchange token slots with the
    other ranks (`ExpertParallelMoE`); everything else is replicated. The model's forward pass runs unchanged."""
    if gpt.config.ffn_type != MoEFeedForward.name:
        raise ValueError(f"expert parallelism splits Mixture-of-Experts layers; this GPT's ffn_type is "
                         f"{gpt.config.ffn_type!r} (use ffn_type='moe')")
    model = copy.deepcopy(gpt)
    for block in model.blocks:
        block.mlp = ExpertParallelMoE(block.mlp, rank, world_size, logs)
    return model


def is_expert_weight(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` is a rank's own experts' weights (not replicated)."""
    module_name, _, attribute = name.rpartition(".")
    return isinstance(model.get_submodule(module_name), ExpertParallelMoE) and attribute in ("gate_up", "down")


def shard_of(ep_model: GPT, name: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the full-size tensor `full` (a parameter or gradient of the single-process GPT called `name`)
    that the expert-parallel parameter of the same name holds on this rank."""
    module_name, _, _ = name.rpartition(".")
    return ep_model.get_submodule(module_name).shard(full) if is_expert_weight(ep_model, name) else full


def average_gradients(model: GPT) -> None:
    """After each rank's backward of the mean loss over its own tokens: what equals one process's gradient of the
    mean loss over the whole batch. Replicated parameters: the average over the ranks (DDP's all-reduce). Experts:
    the exchange already summed every rank's contribution, each scaled for its own rank's mean, so divide by the
    number of ranks (all ranks hold equal numbers of tokens)."""
    world = dist.get_world_size()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if not is_expert_weight(model, name):
            dist.all_reduce(p.grad)
        p.grad.div_(world)
