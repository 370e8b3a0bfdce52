"""What fine-tuning costs and buys: full fine-tuning against LoRA (and LoRA over int8 weights).

Full fine-tuning keeps, beside the weights, a gradient and AdamW's two moments for every weight: four copies of the
model. LoRA keeps them for its adapters only, which are a few per cent of the weights or less; what it still holds
whole is the weights themselves (a quarter of them over an int8 base) and the activations of the step. The plan
(`helpers.measure.memory_plan.training_step_plan` on the meta device) says a step's peak before anything runs, on
any GPU; run on the CPU (`device="cpu"`) the same step is measured instead, which is how a plan is checked.
`compare_fine_tuning` runs each way on the same model and data, to the same number of steps with each seed, and
puts the cost (trainable parameters, state, peak, step time) beside what was learned (held-out answer loss, answers
that end their turn, ROUGE-L).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..inference.quantization import quantize_linears
from ..model.config import GPTConfig
from ..model.gpt import GPT
from ..text.chat import END, ChatExample, exchange_batches, marker_ids
from ..text.instructions import Instruction
from ..training.batches import ExchangeBatches
from ..training.lora import BLOCK_PROJECTIONS, add_lora
from ..training.step import FULL, Loss
from ..training.trainer import TrainConfig, Trainer
from .answers import Answer, answer_questions, answer_summary
from .memory_plan import training_step_plan
from .timing import Spread

# LoRA's alpha, the same at every rank (the LoRA paper keeps it constant as r varies): the update's scale alpha / r
# shrinks as the rank grows, so a learning rate found at one rank suits the others. 32 is 2 x 16, the rank the rates
# are swept at.
LORA_ALPHA = 32.0


def lora(rank: int, alpha: float = LORA_ALPHA, targets: Iterable[str] = BLOCK_PROJECTIONS,
         int8: bool = False, train_tokens: Iterable[int] = ()) -> Callable[[GPT], GPT]:
    """What LoRA does to a model before training, over int8 block weights with `int8` (the LM head and embeddings
    stay in float, as `quantize_linears` leaves them when asked), training the embedding rows of `train_tokens` too
    (the chat markers a model has never seen)."""
    targets, train_tokens = tuple(targets), tuple(train_tokens)

    def prepare(model: GPT) -> GPT:
        if int8:
            quantize_linears(model, skip=("lm_head",))
        return add_lora(model, rank, alpha, targets=targets, train_tokens=train_tokens)

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
                     *, device: str = "meta", autocast: torch.dtype | None = None, fused_attention: bool = True,
                     micro_batches: int = 1, checkpointing: str | None = None, loss: Loss = FULL) -> FineTuningCost:
    """The cost of fine-tuning `GPT(config)` on (batch, seq) token batches, the model first `prepare`d (None: full
    fine-tuning; `lora(rank)`: adapters). device "meta" plans the step; "cpu" runs and measures it. A step of
    `micro_batches` batches, activation `checkpointing` and a chunked `loss` keep fewer activations: the step as
    `training_step_plan` takes it."""
    with torch.device("meta"):
        model = GPT(config)
        state = training_state(prepare(model) if prepare is not None else model)
    plan = training_step_plan(config, batch, seq, autocast=autocast, device=device, prepare=prepare,
                              fused_attention=fused_attention, micro_batches=micro_batches,
                              checkpointing=checkpointing, loss=loss)
    return FineTuningCost(name, state, plan.peak_bytes)


@dataclass(frozen=True)
class Method:
    """A way of fine-tuning: what is done to the model first (None: nothing, every weight trains) and its peak
    learning rate (adapters that start at zero take a larger one than weights already trained)."""

    name: str
    prepare: Callable[[GPT], GPT] | None
    lr: float


@dataclass(frozen=True)
class FineTuningResult:
    """One method run to the same number of steps with each seed: its cost and what it learned. The spreads hold
    one sample per seed, except `step_seconds` (every step of every seed after the first few)."""

    cost: FineTuningCost  # planned on the meta device
    measured_peak_bytes: int  # the same step run and measured on the training device
    step_seconds: Spread
    answer_loss: Spread  # held-out loss per answer token
    ended: Spread  # share of the held-out questions whose answer closed its turn before the limit
    rouge_l: Spread
    answers: tuple[Answer, ...]  # the first seed's, to read beside the references
    model: GPT | None  # with keep_models: the first seed's fine-tuned model (LoRA unmerged), to serve or ask more


def compare_fine_tuning(base: GPT, tokenizer, train: Sequence[ChatExample], validation: Sequence[ChatExample],
                        questions: Sequence[Instruction], methods: Sequence[Method], *, steps: int, batch_size: int,
                        seeds: Sequence[int] = (0,), max_new_tokens: int = 48, device: str = "cpu",
                        warmup_steps: int = 0, keep_models: bool = False) -> list[FineTuningResult]:
    """Fine-tune a copy of `base` (its vocabulary holding the chat markers) with each method and seed for `steps`
    steps of `batch_size` exchanges packed into the context (so every step is the same size, and step times
    compare), then score it on the held-out exchanges and questions. float32 throughout, so that the methods
    differ only in what they train. keep_models: each result holds its first seed's model (otherwise none is kept:
    a sweep of GPT-2-sized models would fill the GPU)."""
    pad, seq = marker_ids(tokenizer)[END], base.config.context_length
    results = []
    for method in methods:
        losses, ended, rouge, seconds, first, first_model = [], [], [], [], None, None
        for seed in seeds:
            model = copy.deepcopy(base)
            torch.manual_seed(seed)  # LoRA's A starts random: the same start with the same seed, whatever ran before
            if method.prepare is not None:
                method.prepare(model)
            config = TrainConfig(steps=steps, batch_size=batch_size, lr=method.lr, min_lr=method.lr / 10,
                                 warmup_steps=warmup_steps, precision="float32", device=device, weight_decay=0.0,
                                 seed=seed)
            trainer = Trainer(model, ExchangeBatches(train, batch_size, pad, seed=seed, pack_length=seq),
                              exchange_batches(validation, batch_size, pad), config)
            trainer.fit(progress=False)
            losses.append(trainer.history["val_loss"][-1])
            seconds += [batch_size * seq / rate for rate in trainer.history["tokens_per_s"][min(3, steps - 1):]]
            answers = answer_questions(model.eval(), tokenizer, questions, max_new_tokens)
            if first is None:
                first, first_model = answers, model if keep_models else None
            summary = answer_summary(answers)
            ended.append(summary["ended"])
            rouge.append(summary["rouge_l"])
        planned = fine_tuning_cost(method.name, base.config, batch_size, seq, method.prepare)
        measured = fine_tuning_cost(method.name, base.config, batch_size, seq, method.prepare, device=device)
        results.append(FineTuningResult(planned, measured.peak_bytes, Spread(tuple(seconds)), Spread(tuple(losses)),
                                        Spread(tuple(ended)), Spread(tuple(rouge)), tuple(first), first_model))
    return results
