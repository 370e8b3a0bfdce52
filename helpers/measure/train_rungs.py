"""The training-speed ladder's rungs: the settings of one training step (`StepSettings`), the rule of each rung
that changes one of them (`RUNGS`, planned for a device by `plan_ladder`), and the step they build: the course's
`TrainingStep` with the optimizer, autocast dtype, compiler, loss and TF32 precision a rung asks for."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..model.config import PRESETS
from ..model.gpt import GPT
from ..model.lm_head import chunk_tokens_for
from ..model.loading import tie_weights
from ..system.device import DeviceCapabilities, autocast_dtype, dtype_name, needs_grad_scaler, parse_dtype
from ..training.step import ChunkedLoss, FullLoss, TrainingStep
from .peer import gpt_logits

VOCAB_MULTIPLE = 64  # matmul tiles and vector widths divide it: 50257 -> 50304
LEARNING_RATE = 3e-4
@dataclass(frozen=True)
class StepSettings:
    """The runtime choices of one training step; each rung of the ladder changes one of them."""

    batch: int  # sequences per micro-batch
    ctx: int  # tokens per sequence
    attn_implementation: str = "eager"  # a name of helpers.model.attention.IMPLEMENTATIONS
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (CUDA, Ampere+)
    fused_adamw: bool = False  # AdamW as one fused kernel (otherwise PyTorch's default implementation)
    autocast: str | None = None  # "bfloat16" or "float16" (with a GradScaler); None trains in fp32
    vocab_multiple: int = 1  # the embedding / LM head rows rounded up to a multiple of this
    accumulation: int = 1  # micro-batches per optimizer step
    compile: bool = False  # model and loss under torch.compile
    loss_chunk: int | None = None  # tokens per chunk of the LM head and loss (GPT.loss_sum); None: the plain head

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.ctx * self.accumulation


@dataclass(frozen=True)
class Rung:
    """One planned rung: the settings it runs with, or None when it does not apply here (`note` says why)."""

    name: str
    label: str
    settings: StepSettings | None
    note: str  # what the rung changes, or why it is skipped


Applied = tuple[StepSettings | None, str]  # a rung's settings (None: it does not apply here) and its note


def _tf32(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    if caps.device_type != "cuda":
        return None, f"TF32 is a tensor-core format of NVIDIA GPUs; fp32 matmuls on {caps.device_type} are unchanged"
    if caps.compute_capability is not None and caps.compute_capability < (8, 0):
        return None, f"TF32 needs compute capability 8.0+ (Ampere or newer); {caps.name} has " \
                     f"{'.'.join(map(str, caps.compute_capability))}"
    return dataclasses.replace(s, tf32=True), "fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs)"


def _fused_adamw(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    return dataclasses.replace(s, fused_adamw=True), "AdamW(fused=True): one kernel updates every parameter"


def _autocast(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    dtype = autocast_dtype(caps)
    if dtype is None:
        return None, f"{caps.name} has neither native bf16 nor fp16 tensor cores: fp32 stays the fastest"
    name = dtype_name(dtype)
    note = f"torch.autocast({caps.device_type!r}, dtype=torch.{name}): matmuls in {name}, weights stay fp32"
    if needs_grad_scaler(dtype):
        note += f"; no native bf16 on {caps.name}, so fp16 with torch.amp.GradScaler"
    return dataclasses.replace(s, autocast=name), note


def _sdpa(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    return (dataclasses.replace(s, attn_implementation="sdpa"),
            "F.scaled_dot_product_attention(is_causal=True): a fused (FlashAttention) kernel, no T x T scores")


def _pad_vocab(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    if vocab_size % VOCAB_MULTIPLE == 0:
        return None, f"the vocabulary ({vocab_size}) is already a multiple of {VOCAB_MULTIPLE}"
    padded = math.ceil(vocab_size / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return (dataclasses.replace(s, vocab_multiple=VOCAB_MULTIPLE),
            f"LM head and embedding padded {vocab_size} -> {padded} rows; the loss ignores the padding")


def _accumulate(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    if accumulation == 1:
        return None, "accumulation=1: no larger batch asked for"
    return (dataclasses.replace(s, accumulation=accumulation),
            f"{accumulation} micro-batches per optimizer step: a {accumulation}x larger batch, one AdamW step")


def _compile(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    return dataclasses.replace(s, compile=True), "torch.compile(model + loss): fused elementwise kernels"


def _chunked_head(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    tokens = s.batch * s.ctx
    if tokens == 1:
        return None, "a micro-batch of one token: nothing to split"
    chunk = min(chunk_tokens_for(vocab_size), 1 << (tokens - 1).bit_length() - 1)  # two chunks at least
    return (dataclasses.replace(s, loss_chunk=chunk),
            f"LM head + cross-entropy {chunk} tokens at a time, gradients computed as they go: the "
            f"{s.batch} x {s.ctx} x vocab logits are never materialised (transformers' GPT-2 has no such step)")


def _baseline(caps: DeviceCapabilities, s: StepSettings, vocab_size: int, accumulation: int) -> Applied:
    return s, "fp32, textbook attention (softmax(QK^T)V materialised), PyTorch's default AdamW"


@dataclass(frozen=True)
class RungRule:
    """One rung of the ladder: its name, its label ({n}: the accumulation; {dtype}: the autocast dtype), and the
    rule that applies its change to the settings below it (caps, settings, vocab_size, accumulation) -> Applied."""

    name: str
    label: str
    apply: Callable[[DeviceCapabilities, StepSettings, int, int], Applied]

    def label_for(self, settings: StepSettings | None, accumulation: int) -> str:
        dtype = settings.autocast if settings is not None and settings.autocast else "bfloat16"
        return self.label.format(n=accumulation, dtype=dtype.replace("bfloat", "bf").replace("float", "fp"))


RUNGS = (
    RungRule("baseline", "fp32 baseline", _baseline),
    RungRule("tf32", "TF32 matmuls", _tf32),
    RungRule("fused_adamw", "fused AdamW", _fused_adamw),
    RungRule("autocast", "{dtype} autocast", _autocast),
    RungRule("sdpa", "SDPA (flash)", _sdpa),
    RungRule("pad_vocab", f"vocab padded to {VOCAB_MULTIPLE}", _pad_vocab),
    RungRule("accumulation", "batch x{n} by accumulation", _accumulate),
    RungRule("compile", "torch.compile", _compile),
    RungRule("chunked_head", "chunked LM head", _chunked_head),
)
LADDER = tuple(rule.name for rule in RUNGS)


def plan_ladder(caps: DeviceCapabilities, batch: int, ctx: int, accumulation: int = 4,
                vocab_size: int = PRESETS["gpt2-small"].vocab_size, until: str | None = None) -> list[Rung]:
    """The rungs for a device (a pure function of its capability record): settings, or why a rung is skipped.

    until: stop after this rung (e.g. "accumulation", to leave out torch.compile's compile time).
    """
    if until is not None and until not in LADDER:
        raise ValueError(f"unknown rung {until!r}; rungs, in order: {', '.join(LADDER)}")
    current, rungs = StepSettings(batch=batch, ctx=ctx), []
    for rule in RUNGS[: None if until is None else LADDER.index(until) + 1]:
        settings, note = rule.apply(caps, current, vocab_size, accumulation)
        rungs.append(Rung(rule.name, rule.label_for(settings, accumulation), settings, note))
        current = settings or current
    return rungs


# ---- the models ----


def padded_vocab_model(model: GPT, multiple: int) -> GPT:
    """A copy of `model` whose embedding and LM head have their rows rounded up to a multiple of `multiple`.

    The real rows are copied, the padding rows are zero; padded ids never occur as inputs, and a loss over the
    first `vocab_size` logits never sees them, so the padded model computes and trains exactly as the original.
    """
    config = model.config
    padded = math.ceil(config.vocab_size / multiple) * multiple
    with torch.device("meta"):
        out = GPT(dataclasses.replace(config, vocab_size=padded), attn_implementation=model.attn_implementation)
    state = {}
    for name, tensor in model.state_dict().items():
        if name in ("tok_emb.weight", "lm_head.weight"):
            tensor = torch.cat([tensor, tensor.new_zeros(padded - config.vocab_size, tensor.size(1))])
        state[name] = tensor.detach().clone()
    out.load_state_dict(state, assign=True)
    return tie_weights(out).train(model.training)


# ---- the training step ----


@contextlib.contextmanager
def matmul_precision(device: torch.device, tf32: bool) -> Iterator[None]:
    """fp32 matmuls on TF32 tensor cores for the duration (CUDA only); the previous setting is restored."""
    if device.type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def ladder_step(model: nn.Module, settings: StepSettings, vocab_size: int,
                forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] = gpt_logits,
                lr: float = LEARNING_RATE) -> TrainingStep:
    """The course's one training step (`helpers.training.step.TrainingStep`) under a rung's settings: AdamW (fused or
    not), the autocast dtype, torch.compile, and the loss over the first `vocab_size` logits (so a padded LM head
    trains as the unpadded one). `forward` maps (model, token ids) to logits: `gpt_logits` for ours, `peer_logits` for
    transformers'."""
    optimizer = torch.optim.AdamW(model.train().parameters(), lr=lr, fused=True if settings.fused_adamw else None)
    chunk = settings.loss_chunk
    loss = FullLoss(vocab_size, forward) if chunk is None else ChunkedLoss(chunk, vocab_size)
    return TrainingStep(model, optimizer, loss=loss, compile=settings.compile,
                        autocast=parse_dtype(settings.autocast) if settings.autocast else None)


def restart(step: TrainingStep, state: dict[str, torch.Tensor], settings: StepSettings) -> None:
    """Back to the weights `state` with a fresh optimizer; the parameters stay the same tensors, so compiled code
    stays valid."""
    with torch.no_grad():
        step.model.load_state_dict(state)
    step.optimizer = torch.optim.AdamW(step.model.parameters(), lr=step.optimizer.defaults["lr"],
                                       fused=True if settings.fused_adamw else None)


def run_step(step: TrainingStep, tf32: bool, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One step on `batches` (the micro-batches of one optimizer step); their mean loss."""
    with matmul_precision(next(step.model.parameters()).device, tf32):
        return step(batches).loss


@dataclass
class BoundStep:
    """A rung's training step bound to its micro-batches: calling it runs one optimizer step and returns the loss."""

    step: TrainingStep
    tf32: bool
    batches: list[tuple[torch.Tensor, torch.Tensor]]

    def __call__(self) -> float:
        return run_step(self.step, self.tf32, self.batches)


def make_batches(vocab_size: int, settings: StepSettings, device: torch.device | str,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`accumulation` micro-batches of random token ids (inputs, next-token targets); speed does not depend on
    the text, and training repeatedly on the same batches must lower the loss."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(settings.accumulation):
        idx = torch.randint(vocab_size, (settings.batch, settings.ctx + 1), generator=generator).to(device)
        batches.append((idx[:, :-1], idx[:, 1:]))
    return batches
