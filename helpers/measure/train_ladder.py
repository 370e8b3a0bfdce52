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
counts the model's FLOPs (`helpers.measure.flops.training_step_flops`, the published vocabulary) against the peak of
the precision the device trains in (`helpers.measure.mfu.peak_flops`: a datasheet for known GPUs, a measured matmul
elsewhere), so MFU rises with tokens/s along the ladder. The race with transformers' GPT-2 is
`helpers.measure.train_peer`.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from ..model.config import GPTConfig
from ..model.gpt import GPT
from ..system.device import autocast_dtype, detect_capabilities
from .flops import training_step_flops
from .mfu import PeakFlops, mfu, peak_flops
from .peer import gpt_logits
from .timing import Spread, timed_rounds, warm_up
from .train_rungs import BoundStep, StepSettings, ladder_step, make_batches, padded_vocab_model, plan_ladder


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

    `climb()` measures every rung; `helpers.measure.train_peer.compare_with_transformers(ladder)` times our best
    rung against the peer; `report()` is everything as one JSON-ready dict. interleave (default: on CPUs and Apple
    GPUs, whose speed other programs share): keep every rung's model and time them in the same rounds, instead of one
    rung after another (which holds one model at a time: what a GPU's memory wants).
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
        self.comparison: dict | None = None  # set by helpers.measure.train_peer.compare_with_transformers

    def flops_per_step(self, settings: StepSettings) -> int:
        return training_step_flops(self.config, settings.batch, settings.ctx) * settings.accumulation

    def model_for(self, settings: StepSettings) -> GPT:
        """The initial weights on this ladder's device, as a rung with `settings` trains them."""
        model = copy.deepcopy(self.initial)
        if settings.vocab_multiple > 1:
            model = padded_vocab_model(model, settings.vocab_multiple)
        return model.set_attn_implementation(settings.attn_implementation).to(self.device)

    def bound_step(self, model: nn.Module, settings: StepSettings, logits=gpt_logits) -> BoundStep:
        """A training step bound to this ladder's batches."""
        return BoundStep(ladder_step(model, settings, self.config.vocab_size, logits), settings.tf32,
                         make_batches(self.config.vocab_size, settings, self.device, self.seed))

    def release(self) -> None:
        """Free what dropped models and steps held (a GPU's cached blocks too)."""
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
        """Measure each rung (cumulative settings); the fastest one's step is kept for the race with transformers.

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
                    step = self.bound_step(self.model_for(rung.settings), rung.settings)
                    warm[rung.name] = warm_up(step, self.warmup)
                    if not self.interleave:
                        seconds, losses = timed_rounds({rung.name: step}, self.steps, self.device)[rung.name]
                        result = self._measured(result, seconds, warm[rung.name] + losses)
                        self._keep_if_best(result, step)
                        del step
                        self.release()
                    else:
                        steps[rung.name] = step
                except Exception as err:  # one rung's failure (out of memory, no compiler) must not end the ladder
                    result = self._error(result, err)
                if result.status == "error":
                    # out of the except block, whose traceback held them: free the failed rung's model and
                    # optimizer before the next rung builds its own
                    step = None
                    self.release()
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
            self.release()
            if on_rung is not None:
                on_rung()
        return results

    def _keep_if_best(self, result: RungResult, step: BoundStep) -> None:
        if self.best is None or result.tokens_per_s > self.best.tokens_per_s:
            self.best, self.best_step = result, step

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
