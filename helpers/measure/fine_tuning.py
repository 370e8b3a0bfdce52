"""What fine-tuning costs in memory: full fine-tuning against LoRA (and LoRA over int8 weights).

Full fine-tuning keeps, beside the weights, a gradient and AdamW's two moments for every weight: four copies of the
model. LoRA keeps them for its adapters only, which are a few per cent of the weights or less; what it still holds
whole is the weights themselves (a quarter of them over an int8 base) and the activations of the step. The plan
(`helpers.measure.memory_plan.training_step_plan` on the meta device) says a step's peak before anything runs, on
any GPU; run on the CPU (`device="cpu"`) the same step is measured instead, which is how a plan is checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..inference.quantization import quantize_linears
from ..model.config import GPTConfig
from ..model.gpt import GPT
from ..training.lora import BLOCK_PROJECTIONS, add_lora
from .memory_plan import training_step_plan


def lora(rank: int, alpha: float | None = None, targets: Iterable[str] = BLOCK_PROJECTIONS,
         int8: bool = False) -> Callable[[GPT], GPT]:
    """What LoRA does to a model before training (alpha: 2 x rank by default), over int8 block weights with
    `int8` (the LM head and embeddings stay in float, as `quantize_linears` leaves them when asked)."""
    targets = tuple(targets)

    def prepare(model: GPT) -> GPT:
        if int8:
            quantize_linears(model, skip=("lm_head",))
        return add_lora(model, rank, 2.0 * rank if alpha is None else alpha, targets=targets)

    return prepare


@dataclass(frozen=True)
class TrainingState:
    """The bytes a model holds while it trains with AdamW: its weights (and buffers), and for every trainable
    parameter a gradient and two moments in the parameter's dtype."""

    parameters: int
    trainable: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def training_state(model: torch.nn.Module) -> TrainingState:
    tensors = list(dict.fromkeys([*model.parameters(), *model.buffers()]))  # a tied weight once
    trainable = [p for p in dict.fromkeys(model.parameters()) if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    return TrainingState(parameters=sum(p.numel() for p in dict.fromkeys(model.parameters())),
                         trainable=sum(p.numel() for p in trainable),
                         weight_bytes=sum(t.numel() * t.element_size() for t in tensors),
                         gradient_bytes=trainable_bytes, optimizer_bytes=2 * trainable_bytes)


@dataclass(frozen=True)
class FineTuningCost:
    """One way of fine-tuning `GPT(config)` at one batch shape: what it trains and holds, and a step's peak."""

    name: str
    state: TrainingState
    peak_bytes: int  # a step's tensors at their highest: planned on meta, or measured on the CPU


def fine_tuning_cost(name: str, config: GPTConfig, batch: int, seq: int, prepare: Callable[[GPT], GPT] | None = None,
                     *, device: str = "meta", autocast: torch.dtype | None = None,
                     fused_attention: bool = True) -> FineTuningCost:
    """The cost of fine-tuning `GPT(config)` on (batch, seq) token batches, the model first `prepare`d (None: full
    fine-tuning; `lora(rank)`: adapters). device "meta" plans the step; "cpu" runs and measures it."""
    with torch.device("meta"):
        model = GPT(config)
        state = training_state(prepare(model) if prepare is not None else model)
    plan = training_step_plan(config, batch, seq, autocast=autocast, device=device, prepare=prepare,
                              fused_attention=fused_attention)
    return FineTuningCost(name, state, plan.peak_bytes)
