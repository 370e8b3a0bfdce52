"""One loss and one training step, for every loop of the course: the Trainer, the speed ladder, the batch-size finder,
the memory probes and the distributed scripts.

* The loss is next-token cross-entropy summed over target tokens (`IGNORE_INDEX` carries none), in fp32 at least:
  a bf16/fp16 log-softmax over 50k classes loses the small probabilities that carry the gradient.
* A step's loss is the mean over *every target token of all its micro-batches*: each micro-batch's backward gets
  (its summed token losses) / (the step's target tokens). Averaging per-micro-batch means instead weights a token
  of a short micro-batch more than one of a long one (the bug fixed in transformers' Trainer in 2024).
* Mixed precision: the forward under `torch.autocast`; fp16 also scales the loss with a `torch.amp.GradScaler`,
  whose gradients are unscaled before clipping, and whose step is skipped when they overflow.

Writing a loss. A step takes any callable `loss(model, x, y)` that returns one micro-batch's loss *summed* over its
target tokens (the positions where `y != IGNORE_INDEX`); the step divides by the target tokens of all its
micro-batches. `FullLoss` and `ChunkedLoss` are next-token cross-entropy; `DistillationLoss` learns a teacher's
whole distribution. The usual others are a few lines each:
- a masked loss (instruction tuning: learn the answers, not the prompts): no new loss, set the prompt's targets to
  IGNORE_INDEX and `FullLoss` skips them;
- a loss plus an auxiliary term (a router's balancing loss): return `base(model, x, y) + weight * aux * n`, where `n`
  is the micro-batch's target tokens, so that the step's division leaves `weight * aux` per token (`RouterLoss`).
A loss with an `after_step(model)` method has it called after each optimizer step that was taken (`RouterLoss`
nudges the routers' balancing biases there).
The `Trainer` takes the same `loss=`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.lm_head import IGNORE_INDEX
from ..model.moe import expert_load, moe_layers, update_router_bias
from ..system.device import needs_grad_scaler


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Summed cross-entropy over the target tokens (IGNORE_INDEX skipped), in fp32 at least. `vocab_size`: only the
    first logits are classes (an LM head padded to a friendlier width trains as the unpadded one)."""
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def token_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) at each position (..., vocab) -> (...), from the target's distribution p to the model's q, in
    float32 at least."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    log_p = F.log_softmax(target_logits.to(dtype), dim=-1)
    log_q = F.log_softmax(logits.to(dtype), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the target tokens of a batch."""
    return token_loss_sum(logits, targets) / (targets != IGNORE_INDEX).sum()


def autocast_context(device_type: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """torch.autocast to `dtype`, or nothing for plain fp32 (None)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def accumulate_gradients(model: nn.Module, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                         scaler: torch.amp.GradScaler | None = None,
                         loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                         ) -> tuple[float, int]:
    """Backpropagate the step's loss — the mean over every target token of all micro-batches — one micro-batch at a
    time; returns (that mean loss, the number of target tokens).

    `loss_sum(x, y)`: the forward and the summed token loss of a micro-batch (default: `model` under `autocast`,
    then `token_loss_sum`); a compiled one, or one for another model's output, fits in.
    """
    if loss_sum is None:
        def loss_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with autocast():
                logits = model(x)
            return token_loss_sum(logits, y)
    n_tokens = int(sum((y != IGNORE_INDEX).sum() for _, y in micro_batches))
    if n_tokens == 0:
        raise ValueError("the micro-batches hold no target tokens (all are IGNORE_INDEX): nothing to learn from")
    total = None
    for x, y in micro_batches:
        summed = loss_sum(x, y)
        loss = summed / n_tokens
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = summed.detach() if total is None else total + summed.detach()
    return total.item() / n_tokens, n_tokens


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean over the step's target tokens
    tokens: int  # target tokens in the step
    grad_norm: float | None  # global gradient norm before clipping (None when neither clipped nor measured)
    stepped: bool = True  # False when the GradScaler skipped the update (fp16 gradients held inf or NaN)


Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]  # (model, x, y) -> summed token loss


@dataclass(frozen=True)
class FullLoss:
    """The loss over logits computed whole: the model's forward pass, then `token_loss_sum`. forward: (model, token
    ids) -> logits, for a model that returns something else (transformers' GPT-2). vocab_size: only the first
    logits are classes (a padded LM head)."""

    vocab_size: int | None = None
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = model(x) if self.forward is None else self.forward(model, x)
        return token_loss_sum(logits, y, self.vocab_size)


@dataclass(frozen=True)
class ChunkedLoss:
    """The LM head and the loss `chunk` tokens at a time (`GPT.loss_sum`), so the logits are never materialised
    whole; the model's own method, so it takes no custom forward. vocab_size: as FullLoss's."""

    chunk: int
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"the loss chunk must be a positive number of tokens, got {self.chunk!r}")

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return model.loss_sum(x, y, self.chunk, self.vocab_size)


@dataclass(frozen=True, eq=False)
class DistillationLoss:
    """KL(p || q) from the teacher's next-token distribution p to the model's q at every target position, summed (as
    `token_loss_sum` sums cross-entropy): the model learns the teacher's whole distribution, not only the text's
    next token (knowledge distillation, Hinton et al. 2015). The teacher runs in eval mode without gradients; both
    distributions are computed in float32 at least. Not reused by `Trainer.fit_or_reuse` (it cannot tell two
    teachers apart)."""

    teacher: nn.Module

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        was_training = self.teacher.training
        with torch.no_grad():
            target = self.teacher.eval()(x)
        self.teacher.train(was_training)
        logits = model(x)
        if logits.shape != target.shape:
            raise ValueError(f"the model's logits {tuple(logits.shape)} and the teacher's {tuple(target.shape)} "
                             "differ: distill between models with the same vocabulary")
        return token_kl(logits, target)[y != IGNORE_INDEX].sum()


@dataclass(frozen=True)
class RouterLoss:
    """A Mixture-of-Experts model's loss: `base` plus, per target token, `balance` x Switch's auxiliary loss and `z`
    x the router z-loss, each averaged over the MoE layers (`helpers.model.moe`); and, with `bias_rate`, DeepSeek-V3's
    balancing bias nudged by that much after each step. balance=z=0 with a bias_rate balances without a loss."""

    base: FullLoss | ChunkedLoss = FullLoss()
    balance: float = 0.01
    z: float = 0.001
    bias_rate: float = 0.0

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.base(model, x, y)
        return loss + self.router_terms(model) * (y != IGNORE_INDEX).sum()

    def router_terms(self, model: nn.Module) -> torch.Tensor:
        """The balance and z terms of the model's last training pass, averaged over its MoE layers; the balance
        term's load is every rank's under expert parallelism (each rank's P is its own tokens', and the ranks'
        gradients average)."""
        layers = moe_layers(model)
        if not layers:
            raise ValueError("RouterLoss balances a Mixture-of-Experts model; this one has no MoE layer "
                             "(ffn_type='moe')")
        return sum(self.balance * layer.routing.balance_loss(expert_load(layer)) + self.z * layer.routing.z_loss()
                   for layer in layers) / len(layers)

    def after_step(self, model: nn.Module) -> None:
        if self.bias_rate:
            update_router_bias(model, self.bias_rate)


FULL = FullLoss()  # the default: the model's logits whole, every one a class


def head_loss(chunk: int | None = None, vocab_size: int | None = None) -> FullLoss | ChunkedLoss:
    """ChunkedLoss(chunk) when a chunk is given, else FullLoss: how a step's loss is named by a plain setting."""
    return FullLoss(vocab_size) if chunk is None else ChunkedLoss(chunk, vocab_size)


class TrainingStep:
    """One optimizer step of `model`: its micro-batches forward and backward (`accumulate_gradients`), gradient
    clipping, then `optimizer` (through a GradScaler when `autocast` is fp16). A failed step leaves no gradients.

    loss: how a micro-batch's summed loss is computed (FullLoss, ChunkedLoss, DistillationLoss, or your own: see the
    module's docstring). autocast: the forward's autocast
    dtype, None for plain fp32. grad_clip: max global gradient norm (None: no clipping); measure_grad_norm: compute
    the norm even without clipping. compile: `torch.compile` the forward and loss.
    autocast_region(device_type, dtype): the context the forward and loss run in, `autocast_context` by default; a
    memory plan of this step on the meta device, which torch.autocast does not support, passes its stand-in
    (`helpers.measure.memory_plan.training_step_plan`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, loss: Loss = FULL,
                 autocast: torch.dtype | None = None, grad_clip: float | None = None, measure_grad_norm: bool = False,
                 compile: bool = False,
                 autocast_region: Callable[[str, torch.dtype | None], contextlib.AbstractContextManager]
                 = autocast_context) -> None:
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be positive or None, got {grad_clip}")
        self.model, self.optimizer, self.grad_clip, self.loss = model, optimizer, grad_clip, loss
        self.measure_grad_norm = measure_grad_norm or grad_clip is not None
        self.device_type = next(model.parameters()).device.type
        self.autocast, self.autocast_region = autocast, autocast_region
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=needs_grad_scaler(autocast))
        self.loss_sum = torch.compile(self._loss_sum) if compile else self._loss_sum

    def _loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.autocast_region(self.device_type, self.autocast):  # token_loss_sum computes in fp32 at least
            return self.loss(self.model, x, y)

    def __call__(self, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        scaler = self.scaler if self.scaler.is_enabled() else None
        try:
            loss, tokens = accumulate_gradients(self.model, micro_batches, scaler=scaler, loss_sum=self.loss_sum)
            grad_norm = None
            if self.measure_grad_norm:
                if scaler is not None:
                    scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                params = [p for group in self.optimizer.param_groups for p in group["params"]]
                max_norm = self.grad_clip if self.grad_clip is not None else math.inf
                grad_norm = float(nn.utils.clip_grad_norm_(params, max_norm))
            scale = self.scaler.get_scale() if scaler is not None else None
            self.scaler.step(self.optimizer)  # skipped when fp16 gradients hold inf/NaN; the scale then backs off
            self.scaler.update()
            stepped = scaler is None or self.scaler.get_scale() >= scale
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        if stepped and hasattr(self.loss, "after_step"):
            self.loss.after_step(self.model)
        return StepResult(loss, tokens, grad_norm, stepped)
