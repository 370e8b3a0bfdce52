"""The training-speed ladder: optimisations added to a GPT training step one at a time, each one measured.

The rungs are cumulative: each keeps what the rungs below it applied and adds one change (`LADDER`). A rung that
does not apply on this device (TF32 on a CPU, bf16 where it is not native) is reported as skipped, with why, and
the next rung builds on the one below it; a rung that fails (out of memory, a compiler error) is reported with its
error and the ladder goes on to the rungs above it. Every rung starts
from the same initial weights and trains on the same batches, so their losses must agree (within the rounding of
their precision), which the report keeps next to the speed.

A training step here is one optimizer step: `accumulation` micro-batches of `batch` sequences of `ctx` tokens,
forward and backward, then AdamW. Speed is tokens per second (median and interquartile range over timed steps,
after warm-up steps; on CPUs the rungs' steps are timed interleaved, so a busy moment hits them alike); MFU
counts the model's FLOPs (`helpers.measure.flops.training_step_flops`, the published vocabulary) against the peak of the
precision the device trains in (`helpers.measure.mfu.peak_flops`: a datasheet for known GPUs, a measured matmul
elsewhere), so MFU rises with tokens/s along the ladder.

The peer: transformers' `GPT2LMHeadModel` with the same configuration (the padded vocabulary too, when our best
rung pads it) and weights, trained by the same step with the same settings as our best rung (dtype, optimizer,
batch, context, attention kernel, accumulation, dropout 0), eager and, when our best rung is compiled, compiled
too; timed interleaved with ours in the same rounds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from ..model.config import PRESETS, GPTConfig
from ..model.gpt import GPT
from ..model.lm_head import chunk_tokens_for
from ..model.loading import tie_weights
from ..system.args import positive_int
from ..system.cli import Command, add_device, add_json, add_scaled, fill_scale_defaults
from ..system.device import (
    DeviceCapabilities,
    autocast_dtype,
    detect_capabilities,
    dtype_name,
    needs_grad_scaler,
    parse_dtype,
)
from ..training.step import ChunkedLoss, FullLoss, TrainingStep
from .flops import training_step_flops
from .mfu import PeakFlops, mfu, peak_flops
from .peer import PEER_ATTENTION, gpt_logits, peer_logits, transformers_peer
from .timing import Spread, timed_rounds, verdict, warm_up

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


# ---- the ladder ----


def rung_tokens_per_s(rung: dict) -> Spread:
    """A measured rung of a report (`report["rungs"][i]`) as tokens/s per timed step, to compare rungs by
    `helpers.measure.timing.verdict`."""
    tokens = StepSettings(**rung["settings"]).tokens_per_step
    return Spread(tuple(tokens / (ms / 1e3) for ms in rung["step_ms_runs"]))


@dataclass
class RungResult:
    name: str
    label: str
    status: str  # "ok", "skipped", "error", or "pending" (set up, its interleaved timing not yet run)
    note: str  # what the rung changes, why it was skipped, or the error
    settings: dict | None = None
    step_ms: float | None = None  # median milliseconds per optimizer step
    tokens_per_s: float | None = None
    step_ms_runs: list[float] | None = None  # every timed step, in milliseconds
    tokens_per_s_iqr: list[float] | None = None  # first and third quartile of tokens/s over the timed steps
    mfu: float | None = None
    first_loss: float | None = None  # the loss of the first step (same weights and batch on every rung)
    last_loss: float | None = None


class Ladder:
    """Climb the rungs of `plan_ladder` on one model configuration, then race transformers' GPT-2.

    `climb()` measures every rung; `compare_with_transformers()` times our best rung against the peer; `report()`
    is everything as one JSON-ready dict. interleave (default: on CPUs and Apple GPUs, whose speed other
    programs share): keep every rung's model and time them in the same rounds, instead of one rung after another
    (which holds one model at a time: what a GPU's memory wants).
    """

    def __init__(self, config: GPTConfig, batch: int, ctx: int, steps: int = 5, warmup: int = 2,
                 accumulation: int = 4, device: str | None = None, until: str | None = None,
                 peak: PeakFlops | None = None, seed: int = 0, model_name: str | None = None,
                 interleave: bool | None = None) -> None:
        check_bench_args(config, batch, ctx, steps, warmup, accumulation, model_name)
        self.caps = detect_capabilities(device)
        self.device = torch.device(device) if device is not None else self.caps.device  # with its index
        self.config = dataclasses.replace(config, dropout=0.0)
        self.model_name, self.steps, self.warmup, self.seed = model_name, steps, warmup, seed
        self.interleave = self.device.type != "cuda" if interleave is None else interleave
        self.plan = plan_ladder(self.caps, batch, ctx, accumulation, config.vocab_size, until)
        dtype = autocast_dtype(self.caps)
        self.peak = peak or peak_flops(self.caps.name, self.caps.device_type, dtype)
        torch.manual_seed(seed)
        self.initial = GPT(self.config)  # every rung starts from these weights (on the CPU)
        self.results: list[RungResult] = []
        self.best: RungResult | None = None  # the fastest rung measured, and its step (for the peer's race)
        self.best_step: BoundStep | None = None
        self.comparison: dict | None = None

    def flops_per_step(self, settings: StepSettings) -> int:
        return training_step_flops(self.config, settings.batch, settings.ctx) * settings.accumulation

    def _model(self, settings: StepSettings) -> GPT:
        model = copy.deepcopy(self.initial)
        if settings.vocab_multiple > 1:
            model = padded_vocab_model(model, settings.vocab_multiple)
        return model.set_attn_implementation(settings.attn_implementation).to(self.device)

    def _step(self, model: nn.Module, settings: StepSettings, logits=gpt_logits) -> BoundStep:
        """A training step bound to this ladder's batches."""
        return BoundStep(ladder_step(model, settings, self.config.vocab_size, logits), settings.tf32,
                         make_batches(self.config.vocab_size, settings, self.device, self.seed))

    def _release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _error(self, result: RungResult, err: Exception) -> RungResult:
        return dataclasses.replace(result, status="error", note=f"{type(err).__name__}: {err}".splitlines()[0])

    def _measured(self, result: RungResult, seconds: list[float], losses: list[float]) -> RungResult:
        s = StepSettings(**result.settings)
        # the median of tokens/s, not tokens over the median time: with an even number of steps those differ, and
        # only the first lies within the quartiles it is shown with
        rate = Spread(tuple(seconds)).map(lambda t: s.tokens_per_step / t)
        return dataclasses.replace(result, status="ok", step_ms=1e3 * statistics.median(seconds),
                                   tokens_per_s=rate.median, step_ms_runs=[1e3 * t for t in seconds],
                                   tokens_per_s_iqr=list(rate.quartiles),
                                   mfu=mfu(self.flops_per_step(s) / s.tokens_per_step * rate.median, self.peak.flops),
                                   first_loss=losses[0], last_loss=losses[-1])

    def climb(self, progress: bool = False, on_rung: Callable[[], None] | None = None) -> list[RungResult]:
        """Measure each rung (cumulative settings); the fastest one's step is kept for `compare_with_transformers`.

        on_rung: called after each rung, when `results` and `report()` include it (a script saves the report, so a
        crash later loses nothing measured).
        """
        torch.compiler.reset()  # compiled code of an earlier ladder in this process must not count here
        results, steps, warm = [], {}, {}
        self.results = results  # filled as the ladder climbs, so report() shows the rungs so far
        for rung in tqdm(self.plan, desc="rungs", disable=not progress):
            result = RungResult(rung.name, rung.label, "skipped", rung.note)
            if rung.settings is not None:
                result = dataclasses.replace(result, status="pending", settings=dataclasses.asdict(rung.settings))
                try:  # errors: e.g. no C++ compiler for torch.compile on a CPU, or out of memory
                    step = self._step(self._model(rung.settings), rung.settings)
                    warm[rung.name] = warm_up(step, self.warmup)
                    if not self.interleave:
                        seconds, losses = timed_rounds({rung.name: step}, self.steps, self.device)[rung.name]
                        result = self._measured(result, seconds, warm[rung.name] + losses)
                        self._keep_if_best(result, step)
                        del step
                        self._release()
                    else:
                        steps[rung.name] = step
                except Exception as err:  # one rung's failure (out of memory, no compiler) must not end the ladder
                    result = self._error(result, err)
                if result.status == "error":
                    # out of the except block, whose traceback held them: free the failed rung's model and
                    # optimizer before the next rung builds its own
                    step = None
                    self._release()
            results.append(result)
            if on_rung is not None:
                on_rung()
        if steps:
            rounds = timed_rounds(steps, self.steps, self.device)
            for i, result in enumerate(results):
                if result.name in rounds:
                    seconds, losses = rounds[result.name]
                    results[i] = self._measured(result, seconds, warm[result.name] + losses)
                    self._keep_if_best(results[i], steps[result.name])
            del steps
            self._release()
            if on_rung is not None:
                on_rung()
        return results

    def _keep_if_best(self, result: RungResult, step: BoundStep) -> None:
        if self.best is None or result.tokens_per_s > self.best.tokens_per_s:
            self.best, self.best_step = result, step

    def compare_with_transformers(self) -> dict:
        """Our best rung against transformers' GPT2LMHeadModel with the same settings, timed in the same rounds:
        eager and, when our best rung is compiled, compiled too.

        The comparison's status says when it could not run (no rung ran, no transformers) or failed (out of
        memory, say: it holds three models), with why; the ladder's measurements stand either way.
        """
        if self.best is None:
            if not self.results:
                raise RuntimeError("climb() the ladder before comparing its best rung")
            self.comparison = {"status": "unavailable",
                               "note": "no rung ran: every rung failed or was skipped (each rung's note says why)"}
            return self.comparison
        best = self.best
        try:
            self.comparison = self._race_transformers()
        except Exception as err:
            self.comparison = {"best_rung": best.name, "settings": best.settings, "status": "error",
                               "note": f"{type(err).__name__}: {err}".splitlines()[0]}
        if self.comparison.get("status") == "error":
            self._release()  # out of the except block, whose traceback held the race's models
        return self.comparison

    def _race_transformers(self) -> dict:
        best, ours = self.best, self.best_step
        s = StepSettings(**best.settings)
        initial = self._model(s)  # the initial weights, padded as our best rung's
        restart(ours.step, initial.state_dict(), s)
        out = {"best_rung": best.name, "settings": best.settings, "vocab_size": initial.config.vocab_size,
               "attn_implementation": PEER_ATTENTION.get(s.attn_implementation)}
        try:
            peer = transformers_peer(initial)
        except (ImportError, ValueError) as err:
            return {**out, "status": "unavailable", "note": str(err)}
        same = dataclasses.replace(s, loss_chunk=None)  # transformers' GPT-2 has no chunked head: the plain one
        steps = {"ours": ours,
                 "transformers_eager": self._step(peer, dataclasses.replace(same, compile=False), peer_logits)}
        if s.compile:
            steps["transformers_compiled"] = self._step(copy.deepcopy(peer), same, peer_logits)
        warm = {name: warm_up(step, self.warmup) for name, step in steps.items()}
        rounds = timed_rounds(steps, self.steps, self.device)
        spread = {name: Spread(tuple(seconds)).map(lambda t: s.tokens_per_step / t)
                  for name, (seconds, _) in rounds.items()}
        tokens = {name: rate.median for name, rate in spread.items()}
        peer_name = "transformers_compiled" if s.compile else "transformers_eager"
        out |= {"status": "ok",
                "note": "transformers trained with our best rung's settings (those it has), timed interleaved",
                "ours_tokens_per_s": tokens["ours"],
                "transformers_eager_tokens_per_s": tokens["transformers_eager"],
                "transformers_compiled_tokens_per_s": tokens.get("transformers_compiled"),
                **{f"{name}_tokens_per_s_iqr": list(spread[name].quartiles) for name in steps},
                # a ratio only where it holds beyond the noise of the interleaved steps
                "verdict": verdict("ours", spread["ours"], peer_name.replace("_", " "), spread[peer_name]),
                "first_loss": {name: losses[0] for name, losses in warm.items()}}
        del steps, peer, initial
        self._release()
        return out

    def report(self) -> dict:
        """The ladder and the race as one JSON-ready dict (`rungs`, `ratio_vs_transformers`, ...)."""
        c = self.comparison or {}
        ok = c.get("status") == "ok"
        eager = c["ours_tokens_per_s"] / c["transformers_eager_tokens_per_s"] if ok else None
        compiled = (c["ours_tokens_per_s"] / c["transformers_compiled_tokens_per_s"]
                    if ok and c["transformers_compiled_tokens_per_s"] else None)
        same = compiled if compiled is not None else eager
        plan = self.plan[0].settings
        return {
            "model": self.model_name, "config": dataclasses.asdict(self.config),
            "device": self.caps.device_type, "device_name": self.caps.name, "torch": torch.__version__,
            "batch": plan.batch, "ctx": plan.ctx, "steps": self.steps, "warmup": self.warmup,
            "peak_flops": self.peak.flops, "peak_source": self.peak.source,
            "flops_per_token": training_step_flops(self.config, plan.batch, plan.ctx) / (plan.batch * plan.ctx),
            "rungs": [dataclasses.asdict(r) for r in self.results],
            "best_rung": self.best.name if self.best else None,
            "transformers": c or None,
            # ours over transformers with our best rung's settings (compiled if it is compiled)
            "ratio_vs_transformers": same,
            "ratio_vs_transformers_eager": eager,
            "ratio_vs_transformers_compiled": compiled,
            "ratio_vs_transformers_is": None if same is None else ("compiled" if compiled is not None else "eager"),
        }


def check_bench_args(config: GPTConfig, batch: int, ctx: int, steps: int, warmup: int, accumulation: int,
                     model_name: str | None = None) -> None:
    """Refuse sizes that cannot run, saying what to pass instead."""
    if not 1 <= ctx <= config.context_length:
        raise ValueError(f"ctx={ctx} is outside 1..{config.context_length} ({model_name or 'the model'}'s context "
                         f"length); pass ctx={config.context_length} or less")
    for name, value in (("batch", batch), ("steps", steps), ("warmup", warmup), ("accumulation", accumulation)):
        if value < 1:
            raise ValueError(f"{name}={value} must be 1 or more")


def bench_train(model: str, batch: int, ctx: int, steps: int = 5, warmup: int = 2, accumulation: int = 4,
                device: str | None = None, until: str | None = None, progress: bool = False,
                on_report: Callable[[dict], None] | None = None) -> dict:
    """Climb the ladder for a preset and race transformers: the report of `python -m helpers bench-train`.

    on_report: called with the report so far after each rung and after the race (to save it as it grows).
    """
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; valid presets: {', '.join(PRESETS)}")
    ladder = Ladder(PRESETS[model], batch, ctx, steps, warmup, accumulation, device, until, model_name=model)
    ladder.climb(progress, on_rung=None if on_report is None else lambda: on_report(ladder.report()))
    ladder.compare_with_transformers()
    if on_report is not None:
        on_report(ladder.report())
    return ladder.report()


def format_report(report: dict) -> str:
    """The ladder as a table, then the comparison with transformers."""
    lines = [f"{report['model']}: batch {report['batch']} x ctx {report['ctx']} on {report['device_name']}; "
             f"MFU against {report['peak_flops'] / 1e12:.2f} TFLOP/s, {report['peak_source']}",
             f"{'rung':<26} {'status':<8} {'ms/step':>9} {'tokens/s':>10} {'IQR':>15} {'MFU':>7} {'x base':>7} "
             f"{'loss 1st':>9}"]
    base = next((r for r in report["rungs"] if r["status"] == "ok"), None)
    for r in report["rungs"]:
        if r["status"] != "ok":
            lines.append(f"{r['label']:<26} {r['status']:<8} {r['note']}")
            continue
        # "~": within the noise of the first measured rung (their IQRs overlap)
        same = r is not base and rung_tokens_per_s(r).overlaps(rung_tokens_per_s(base))
        gain = f"{'~' if same else ''}{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
        iqr = "{:,.0f}–{:,.0f}".format(*r["tokens_per_s_iqr"])
        lines.append(f"{r['label']:<26} {'ok':<8} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {iqr:>15} "
                     f"{r['mfu']:>7.2%} {gain:>7} {r['first_loss']:>9.4f}")
    c = report["transformers"]
    if c is None or c["status"] != "ok":
        lines.append(f"transformers: {c['note'] if c else 'not compared'}")
        return "\n".join(lines)
    lines.append(f"transformers' GPT2LMHeadModel with the settings of '{c['best_rung']}' ({c['attn_implementation']}):")
    lines.append(f"  ours {c['ours_tokens_per_s']:,.0f} tokens/s, transformers eager "
                 f"{c['transformers_eager_tokens_per_s']:,.0f} (x{report['ratio_vs_transformers_eager']:.2f})")
    if report["ratio_vs_transformers_compiled"] is not None:
        lines[-1] += (f", compiled {c['transformers_compiled_tokens_per_s']:,.0f} "
                      f"(x{report['ratio_vs_transformers_compiled']:.2f})")
    lines.append(f"  same settings: {c['verdict']}")
    return "\n".join(lines)


def plot_ladder(report: dict):
    """Tokens/s and MFU per rung with their interquartile ranges (skipped rungs marked), with transformers' GPT-2
    for reference; a Figure."""
    import matplotlib.pyplot as plt

    rungs = report["rungs"]
    labels = [r["label"] for r in rungs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, unit in ((ax1, "tokens_per_s", "training tokens/s"), (ax2, "mfu", "MFU (%)")):
        scale = 100 if key == "mfu" else 1
        values = [scale * r[key] if r["status"] == "ok" else 0 for r in rungs]
        # MFU is tokens/s times a constant (FLOPs per token over the peak): the same quartiles, rescaled
        quartiles = [[v * q / r["tokens_per_s"] for q in r["tokens_per_s_iqr"]] if r["status"] == "ok" else [0, 0]
                     for v, r in zip(values, rungs, strict=True)]
        below_above = [[v - q1 for v, (q1, _) in zip(values, quartiles, strict=True)],
                       [q3 - v for v, (_, q3) in zip(values, quartiles, strict=True)]]
        bars = ax.bar(range(len(rungs)), values, yerr=below_above, capsize=3,
                      color=["C0" if r["status"] == "ok" else "0.8" for r in rungs])
        for bar, r in zip(bars, rungs, strict=True):
            if r["status"] != "ok":
                ax.annotate(r["status"], (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom",
                            rotation=90, fontsize=8, xytext=(0, 3), textcoords="offset points")
        ax.set_xticks(range(len(rungs)), labels, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(unit)
    c = report["transformers"]
    legend = False
    if c and c["status"] == "ok":
        for name, style in (("transformers_eager_tokens_per_s", "--"), ("transformers_compiled_tokens_per_s", ":")):
            if c[name]:
                ax1.axhline(c[name], color="C3", linestyle=style,
                            label=f"transformers GPT-2, {name.split('_')[1]} ({c['best_rung']} settings)")
        ax1.axhline(c["ours_tokens_per_s"], color="C2", linestyle="-", linewidth=0.8,
                    label="ours, best rung, timed with transformers")
        fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)  # below the axes, clear of the lines
        legend = True
    ax1.set_title(f"{report['model']}: batch {report['batch']} x {report['ctx']} tokens, median and IQR", fontsize=10)
    ax2.set_title(f"MFU against {report['peak_flops'] / 1e12:.3g} TFLOP/s, {report['peak_source']}", fontsize=9)
    fig.suptitle(report["device_name"])
    fig.tight_layout(rect=(0, 0.07 if legend else 0, 1, 1))
    return fig


def _arguments(parser) -> None:
    add_scaled(parser, COMMAND, "model", "preset, random weights", choices=list(PRESETS), type=str)
    add_scaled(parser, COMMAND, "batch", "sequences per micro-batch")
    add_scaled(parser, COMMAND, "ctx", "tokens per sequence, at most the preset's context")
    add_scaled(parser, COMMAND, "steps", "timed optimizer steps per rung; median and IQR")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps first, compilation included (default: 2)")
    parser.add_argument("--accumulation", type=positive_int, default=4,
                        help="micro-batches per optimizer step on the accumulation rung (default: 4)")
    parser.add_argument("--until", choices=LADDER, help="stop after this rung (e.g. accumulation: no torch.compile)")
    add_device(parser)
    add_json(parser, "a table")


def _run(args) -> int:
    ctx_given = args.ctx is not None
    device = fill_scale_defaults(args, COMMAND)
    context = PRESETS[args.model].context_length
    ctx = args.ctx if ctx_given else min(args.ctx, context)
    if ctx > context:
        args.command_parser.error(f"--ctx {ctx} is longer than {args.model}'s context length; pass --ctx "
                                  f"{context} or less")
    try:
        report = bench_train(args.model, args.batch, ctx, args.steps, args.warmup, args.accumulation, device,
                             args.until, progress=True)
    except ValueError as err:  # sizes that cannot run: say which flag to change, no traceback
        args.command_parser.error(str(err))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


COMMAND = Command("bench-train", "the training-speed ladder (tokens/s, MFU) and transformers' GPT-2", _arguments, _run,
                  scale_defaults={"smoke": dict(model="gpt-smoke", batch=2, ctx=64, steps=2),
                                  "cpu": dict(model="gpt-cpu", batch=4, ctx=128, steps=5),
                                  "gpu": dict(model="gpt2-small", batch=8, ctx=1024, steps=10)})
