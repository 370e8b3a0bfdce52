"""A Mixture-of-Experts feed-forward (ffn_type="moe"): a router sends each token to `experts_per_token` of
`n_experts` SwiGLU experts and adds their outputs, weighted by the router's probabilities.

The model holds every expert's weights but a token runs through k of them, so the FLOPs per token are those of k
experts (plus the router) while the parameters are those of all of them: the *active* against the *total*
parameters.

Routing (`GPTConfig.moe_router`). The router's logits become probabilities over all experts (softmax); a token
takes the k most probable. "softmax_topk" weights each chosen expert by its probability as it is (Switch, DeepSeek,
Qwen3-MoE without `norm_topk_prob`: the weights sum to less than 1); "topk_softmax" takes the top-k logits first
and softmaxes over those (Mixtral), which equals the softmax-then-top-k probabilities renormalised to sum to 1
(Qwen3-MoE's `norm_topk_prob`).

Balance. Left alone, a router sends most tokens to a few experts (they train faster, so they win more tokens). Two
remedies: the Switch auxiliary loss, E · Σ_e f_e · P_e (f_e the share of token slots sent to expert e, P_e its mean
probability), which is smallest when both are uniform, with the router z-loss (the mean squared log-sum-exp of the
logits, keeping them small), added to the training loss (`helpers.training.step.RouterLoss`); or DeepSeek-V3's
auxiliary-loss-free bias: a per-expert bias added to the scores for *choosing* experts only (not for weighting
them), raised for experts that got fewer tokens than average and lowered for the others after each step
(`update_router_bias`).

Capacity (`GPTConfig.capacity_factor`). With a capacity factor c, an expert takes at most ⌈c · tokens · k / E⌉
token slots of a training batch, in token order; the slots beyond it are dropped (the token keeps its residual
stream, and the dropped count is recorded). None: no limit. In eval mode there is none either: what a token gets must
not depend on the other tokens of its batch (a served request's on the others served with it, a cached decode step
on the prompt before it).

Dispatch (`MoEFeedForward.dispatch`). "loop": each expert gathers its tokens, runs, and adds its weighted output
back. "sorted": the token slots are sorted by expert so that each expert's tokens are contiguous, and both matmuls
run as one grouped matrix product over the segments (`torch._grouped_mm`, where the installed torch runs it for the
dtype and needs no gradient; otherwise a loop over the sorted segments). "gather": each token slot gathers its
expert's weights, so no shape depends on the routing; it copies k experts' weights per token, which suits a decode
step of a few tokens only, and it is what a compiled forward of up to `GATHER_TOKENS` tokens runs (the compiled
decode step, which needs fixed shapes); a larger compiled forward runs the chosen dispatch, with graph breaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .feed_forward import (
    Elementwise,
    FeedForwardPart,
    HFLayout,
    Matmul,
    SwiGLUFeedForward,
    register_feed_forward,
    silu_gate,
)
from .hf_files import WeightsError

if TYPE_CHECKING:
    from .config import GPTConfig

DISPATCHES = ("loop", "sorted", "gather")
GATHER_TOKENS = 256  # up to this many tokens a compiled forward gathers each slot's weights (a decode step)


@dataclass(frozen=True)
class Routing:
    """Where a batch's tokens went: for each token its k experts and their weights, which of those slots an
    expert's capacity kept, and the router's logits and probabilities (for the balancing losses)."""

    experts: torch.Tensor  # (tokens, k) expert ids
    weights: torch.Tensor  # (tokens, k)
    kept: torch.Tensor  # (tokens, k) bool
    logits: torch.Tensor  # (tokens, n_experts), float32 at least
    probs: torch.Tensor  # (tokens, n_experts)

    @property
    def load(self) -> torch.Tensor:
        """Token slots each expert was chosen for (before capacity), (n_experts,)."""
        return torch.bincount(self.experts.flatten(), minlength=self.probs.size(-1))

    @property
    def dropped(self) -> int:
        return int((~self.kept).sum())

    def balance_loss(self, load: torch.Tensor | None = None) -> torch.Tensor:
        """Switch Transformer's auxiliary loss E · Σ_e f_e · P_e: 1 when routing is uniform, E when one expert
        takes everything (k=1; at most E/k with k experts a token). f (the slots' shares) has no gradient; P (the
        mean probabilities) carries it. `load`: the slot counts f is taken from, by default this batch's; over
        several ranks the whole batch's (`expert_load`), so the ranks' losses average to one process's."""
        n_experts = self.probs.size(-1)
        load = self.load if load is None else load
        share = load.to(self.probs.dtype) / load.sum()
        return n_experts * (share * self.probs.mean(0)).sum()

    def z_loss(self) -> torch.Tensor:
        """ST-MoE's router z-loss: the mean squared log-sum-exp of the logits."""
        return torch.logsumexp(self.logits, dim=-1).square().mean()


def route(logits: torch.Tensor, k: int, order: str, bias: torch.Tensor | None = None,
          capacity_factor: float | None = None) -> Routing:
    """Choose k experts per token from router logits (tokens, E): by probability plus `bias` (which only chooses),
    weighted as `order` says; then each expert keeps its first ⌈capacity_factor · tokens · k / E⌉ slots."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    probs = torch.softmax(logits, dim=-1)
    scores = probs if bias is None else probs + bias
    experts = scores.topk(k, dim=-1).indices
    if order == "softmax_topk":
        weights = probs.gather(-1, experts)
    else:  # softmax over the chosen logits: the chosen probabilities, renormalised
        weights = torch.softmax(logits.gather(-1, experts), dim=-1)
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        n_experts = logits.size(-1)
        capacity = math.ceil(capacity_factor * experts.numel() / n_experts)
        one_hot = F.one_hot(experts.flatten(), n_experts)  # slots in token order, then rank within a token
        kept = (one_hot.cumsum(0) * one_hot).sum(-1).view_as(experts) <= capacity
    return Routing(experts, weights, kept, logits, probs)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: x (n, d) -> (n, d) with gate_up (2h, d) and down (d, h)."""
    return F.linear(silu_gate(*F.linear(x, gate_up).chunk(2, dim=-1)), down)


NO_GROUPED_MM: set[tuple[str, torch.dtype]] = set()  # (device type, dtype) where torch._grouped_mm failed to run


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows x[ends[e-1]:ends[e]] times weights[e]ᵀ for every expert e, (rows, out): one grouped matrix product
    where torch runs it (its CPU kernels, newer than the CUDA ones, take float32 and bfloat16 rows of 16-byte
    multiples and have no backward in torch 2.13), else one matmul per segment: the same numbers either way."""
    weights = weights.to(x.dtype)
    where = (x.device.type, x.dtype)
    if (hasattr(torch, "_grouped_mm") and where not in NO_GROUPED_MM
            and not (torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad))
            and (x.size(-1) * x.element_size()) % 16 == 0 and (weights.size(1) * x.element_size()) % 16 == 0):
        try:
            return torch._grouped_mm(x, weights.transpose(-2, -1), offs=ends.to(torch.int32))
        except (RuntimeError, NotImplementedError, TypeError):  # no kernel here (or another signature)
            NO_GROUPED_MM.add(where)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]]).tolist()
    return torch.cat([F.linear(x[s:e], w) for s, e, w in zip(starts, ends.tolist(), weights, strict=True)])


@register_feed_forward
class MoEFeedForward(FeedForwardPart):
    """n_experts SwiGLU experts behind a linear router, k per token, with an optional shared expert every token
    runs (DeepSeek, Qwen2-MoE). Each expert is as wide as `ffn_hidden` (default: a dense SwiGLU's width)."""

    name = "moe"
    tensor_parallel = {}  # replicated under Megatron-style splits: experts are split by expert parallelism
    hf_layouts = {"qwen3_moe": HFLayout({}, ("silu",))}  # Qwen3-MoE's block: names by expert (`hf_weights`)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hidden, n = config.d_model, self.hidden_dim(config), config.n_experts
        self.k, self.order, self.capacity_factor = config.experts_per_token, config.moe_router, config.capacity_factor
        self.router = nn.Linear(d, n, bias=False)
        self.gate_up = nn.Parameter(torch.empty(n, 2 * hidden, d))  # each expert's gate and up rows, stacked
        self.down = nn.Parameter(torch.empty(n, d, hidden))
        for weight in (self.gate_up, self.down):
            nn.init.normal_(weight, mean=0.0, std=0.02)
        self.register_buffer("router_bias", torch.zeros(n))  # DeepSeek-V3's balancing bias: chooses, never weights
        self.shared = SwiGLUFeedForward(config) if config.shared_expert else None
        self.dropout = nn.Dropout(config.dropout)
        self.dispatch = "loop"
        self.routing: Routing | None = None  # the last training forward pass's: for the balancing losses and plots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"unknown dispatch {self.dispatch!r}; valid: {', '.join(DISPATCHES)}")
        flat = x.reshape(-1, x.size(-1))
        capacity = self.capacity_factor if self.training else None  # inference: a token's output is its own alone
        routing = route(self.router(flat), self.k, self.order, self.router_bias, capacity)
        if self.training:
            self.routing = routing
        # fixed shapes for a compiled decode step (fullgraph); gathering weights per slot suits a few tokens only
        compiled_decode = torch.compiler.is_compiling() and flat.size(0) <= GATHER_TOKENS
        dispatch = "gather" if compiled_decode else self.dispatch
        out = self.dropout(getattr(self, dispatch)(flat, routing).to(x.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)  # (with its own dropout)
        return out.view_as(x)

    @staticmethod
    def slots(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept token slots: (token index, expert, weight), in token order."""
        token = torch.arange(r.experts.size(0), device=r.experts.device)[:, None].expand_as(r.experts)
        return token[r.kept], r.experts[r.kept], r.weights[r.kept]

    def loop(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Each expert gathers its tokens, runs on them, and adds its weighted output back."""
        token, expert, weight = self.slots(routing)
        out = torch.zeros_like(flat, dtype=torch.promote_types(flat.dtype, weight.dtype))
        for e in range(self.gate_up.size(0)):
            mine = expert == e
            if mine.any():
                y = expert_mlp(flat[token[mine]], self.gate_up[e], self.down[e])
                out = out.index_add(0, token[mine], (y * weight[mine, None].to(y.dtype)).to(out.dtype))
        return out

    def sorted(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The slots sorted by expert, so each expert's tokens are one contiguous segment; both matmuls grouped."""
        token, expert, weight = self.slots(routing)
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        ends = torch.bincount(expert, minlength=self.gate_up.size(0)).cumsum(0)
        hidden = silu_gate(*grouped_linear(flat[token], self.gate_up, ends).chunk(2, dim=-1))
        y = grouped_linear(hidden, self.down, ends)
        out = torch.zeros_like(flat, dtype=torch.promote_types(flat.dtype, weight.dtype))
        return out.index_add(0, token, (y * weight[:, None].to(y.dtype)).to(out.dtype))

    def gather(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Each token slot with its own expert's weights (tokens, k, ...): shapes fixed by tokens and k alone."""
        weight = (routing.weights * routing.kept).to(flat.dtype)
        gate_up = self.gate_up[routing.experts].to(flat.dtype)  # (tokens, k, 2h, d)
        hidden = silu_gate(*torch.einsum("nd,nkhd->nkh", flat, gate_up).chunk(2, dim=-1))
        y = torch.einsum("nkh,nkdh->nkd", hidden, self.down[routing.experts].to(flat.dtype))
        return (y * weight[..., None]).sum(1)

    @classmethod
    def hidden_dim(cls, config: GPTConfig) -> int:
        return SwiGLUFeedForward.hidden_dim(config)

    @classmethod
    def matmuls(cls, config: GPTConfig) -> list[Matmul]:
        """Per token: the router, and k experts' matmuls (the active ones), plus the shared expert's."""
        hidden, k, d, n = cls.hidden_dim(config), config.experts_per_token, config.d_model, config.n_experts
        active = [Matmul("router", d, n),
                  Matmul(f"experts' gate and up ({k} of {n} a token)", d, 2 * hidden, weights=n, per_token=k),
                  Matmul(f"experts' down ({k} of {n} a token)", hidden, d, weights=n, per_token=k)]
        return active + (SwiGLUFeedForward.matmuls(config) if config.shared_expert else [])

    @classmethod
    def elementwise(cls, config: GPTConfig) -> list[Elementwise]:
        width = cls.hidden_dim(config) * (config.experts_per_token + config.shared_expert)
        return [Elementwise("SiLU(gate) · up, active experts", 5, width, silu_gate, inputs=2)]

    def residual_weights(self) -> list[torch.Tensor]:
        return [self.down] + (self.shared.residual_weights() if self.shared is not None else [])

    @classmethod
    def hf_weights(cls, config: GPTConfig, layout: str) -> dict[str, tuple[str, ...]]:
        """Qwen3-MoE's `gate` is our router; its experts' gate, up and down projections, expert by expert, are the
        rows of our stacked `gate_up` and `down`."""
        experts = range(config.n_experts)
        return {"router.weight": ("gate.weight",),
                "gate_up": tuple(f"experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up")),
                "down": tuple(f"experts.{e}.down_proj.weight" for e in experts)}

    @classmethod
    def hf_config(cls, config: GPTConfig, layout: str) -> dict:
        refused = [what for what, bad in (("shared_expert=True", config.shared_expert),
                                          ("a capacity_factor", config.capacity_factor is not None)) if bad]
        if refused:
            raise WeightsError(f"Qwen3-MoE's layout has no place for {' or '.join(refused)}; export a model with "
                               "shared_expert=False and capacity_factor=None")
        hidden = cls.hidden_dim(config)
        # transformers 5 calls the count num_local_experts, 4.x num_experts: both, so either reads it
        return dict(num_experts=config.n_experts, num_local_experts=config.n_experts,
                    num_experts_per_tok=config.experts_per_token,
                    moe_intermediate_size=hidden, norm_topk_prob=config.moe_router == "topk_softmax",
                    decoder_sparse_step=1, mlp_only_layers=[])

    @classmethod
    def config_from_hf(cls, hf: dict, layout: str) -> dict:
        if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
            raise WeightsError("this Qwen3-MoE checkpoint mixes dense and sparse blocks (decoder_sparse_step, "
                               "mlp_only_layers), but every block of helpers.GPT has the same feed-forward; use "
                               "transformers for it")
        return dict(n_experts=hf.get("num_local_experts", hf.get("num_experts")),
                    experts_per_token=hf["num_experts_per_tok"],
                    ffn_hidden=hf["moe_intermediate_size"],
                    moe_router="topk_softmax" if hf.get("norm_topk_prob") else "softmax_topk")


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's Mixture-of-Experts layers: this module's, and any that route as it does (one rank's share of
    them under expert parallelism, `helpers.parallel.expert_parallel`): what has a router bias and a routing."""
    return [module for module in model.modules() if hasattr(module, "router_bias") and hasattr(module, "routing")]


def expert_load(layer: nn.Module) -> torch.Tensor:
    """Token slots each expert was chosen for in the layer's last training pass (summed over the ranks where the
    layer says how: `global_load`)."""
    if layer.routing is None:
        raise ValueError("no training forward pass has run through this MoE layer: balance after a training step")
    return layer.global_load() if hasattr(layer, "global_load") else layer.routing.load


@torch.no_grad()
def update_router_bias(model: nn.Module, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after an optimizer step: each MoE layer raises the bias of the
    experts that got fewer token slots than the mean in its last training pass by `rate`, and lowers the others'."""
    for layer in moe_layers(model):
        load = expert_load(layer).to(layer.router_bias.dtype)
        layer.router_bias += rate * torch.sign(load.mean() - load)


def active_parameters(model: nn.Module) -> int:
    """The parameters one token's forward pass uses: all of them but, in each MoE layer, the experts it does not
    run (n_experts - k of them). What a decode step of one sequence reads, against what the model holds."""
    idle = sum((layer.gate_up.size(0) - layer.k) * (layer.gate_up[0].numel() + layer.down[0].numel())
               for layer in model.modules() if isinstance(layer, MoEFeedForward))
    return sum(p.numel() for p in dict.fromkeys(model.parameters())) - idle
