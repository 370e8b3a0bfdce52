"""The pretraining loop: exact gradient accumulation, mixed precision, a warm-up + decay learning rate, gradient
clipping, periodic evaluation and samples, atomic checkpoints and an exact resume.

Exact resume means that training N steps gives the same parameters as training k steps, saving, loading into a
fresh process and training N - k more: the checkpoint holds the model, the optimizer, the gradient scaler, the
schedule's step, every random-number generator and the data position.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from ..model.decoding import Sampling
from ..system.device import (
    default_device_type,
    detect_capabilities,
    synchronize,
)
from ..system.files import cache_dir
from .batches import Batches, ShuffledBatches, evaluation_windows
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .lr_schedule import check_schedule, learning_rate
from .precision import check_precision_name, resolve_precision
from .step import FULL, IGNORE_INDEX, ChunkedLoss, FullLoss, Loss, RouterLoss, TrainingStep, token_loss_sum

SAMPLE_SAMPLING = Sampling(temperature=0.8, top_k=40)  # the samples shown during training


@dataclass
class TrainConfig:
    """What a training run does; saved in its checkpoints."""

    steps: int  # optimizer steps in the whole run (the schedule's length)
    batch_size: int = 8  # sequences per micro-batch
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 0
    schedule: str = "cosine"  # see helpers.training.lr_schedule.SCHEDULES
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = 1.0  # max global gradient norm; None: no clipping
    precision: str = "auto"  # auto | float32 | bfloat16 | float16
    eval_interval: int = 0  # 0: evaluate only after the last step
    eval_batches: int = 8
    sample_interval: int = 0  # 0: no samples during training
    sample_prompt: str = "\n"
    sample_tokens: int = 32
    checkpoint_path: str | None = None
    checkpoint_interval: int = 0  # 0: checkpoint only after the last step (when checkpoint_path is set)
    seed: int = 0
    device: str | None = None  # None: CUDA, else MPS, else CPU

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum_steps", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be 1 or more, got {getattr(self, name)}")
        for name in ("eval_interval", "sample_interval", "checkpoint_interval", "sample_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be 0 or more, got {getattr(self, name)}")
        check_schedule(self.schedule, self.lr, self.steps, self.warmup_steps, self.min_lr)
        check_precision_name(self.precision)
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive or None, got {self.grad_clip}")


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    """The states as saved; a checkpoint loaded onto a GPU brought them there, and torch takes them from the CPU."""
    torch.set_rng_state(states["torch"].cpu())
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state.cpu() for state in states["cuda"]])


def make_optimizer(model: nn.Module, config: TrainConfig, fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only: decaying biases and LayerNorm gains towards 0
    only fights the normalisation (GPT-2 / nanoGPT practice)."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))  # a tied weight once
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=fused)


class Trainer:
    """Trains a `helpers.GPT`; `fit()` runs to `config.steps` (or fewer), `save()`/`load()` checkpoint and resume,
    `history` holds the curves and samples.

    train: a token stream (its windows served by `ShuffledBatches`) or any `helpers.training.batches.Batches`
    (chat exchanges: `ExchangeBatches`). val: a token stream (`config.eval_batches` batches of its windows), a list
    of (x, y) batches (`helpers.text.chat.exchange_batches`), or None.

    loss: what each step minimises (`helpers.training.step`: next-token cross-entropy `FULL` by default, computed
    whole or `ChunkedLoss`; `DistillationLoss` from a teacher; or your own, as that module says). Validation
    (`evaluate`) stays next-token cross-entropy, the figure every run is compared by."""

    @property
    def scaler(self) -> torch.amp.GradScaler:
        """The gradient scaler the training step uses; assigning one (another initial scale, a short growth
        interval) makes the steps use it."""
        return self.training_step.scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler) -> None:
        self.training_step.scaler = scaler

    def __init__(self, model: nn.Module, train: torch.Tensor | Batches,
                 val: torch.Tensor | list[tuple[torch.Tensor, torch.Tensor]] | None, config: TrainConfig,
                 tokenizer=None, fused_adamw: bool | None = None, loss: Loss = FULL) -> None:
        self.config = config
        self.device = torch.device(config.device or default_device_type())
        self.precision = resolve_precision(config.precision, detect_capabilities(self.device.type))
        self.model = model.to(self.device)
        self.context_length = model.config.context_length
        self.tokenizer = tokenizer
        self.optimizer = make_optimizer(self.model, config, fused=fused_adamw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.loss = loss
        self.training_step = TrainingStep(self.model, self.optimizer, loss=loss, autocast=self.precision.dtype,
                                          grad_clip=config.grad_clip, measure_grad_norm=True)
        if isinstance(train, torch.Tensor):
            train = ShuffledBatches(train, config.batch_size, self.context_length, config.seed)
        if train.batch_size != config.batch_size:
            raise ValueError(f"the batches hold {train.batch_size} examples each but config.batch_size is "
                             f"{config.batch_size}: make them agree")
        self.batches = train
        if isinstance(val, torch.Tensor):
            x, y = evaluation_windows(val, self.context_length, config.eval_batches * config.batch_size)
            val = list(zip(x.split(config.batch_size), y.split(config.batch_size), strict=True))
        self.val = val
        self.step = 0
        self.history: dict[str, list] = {key: [] for key in (
            "step", "loss", "lr", "grad_norm", "tokens_per_s", "val_step", "val_loss", "samples")}
        torch.manual_seed(config.seed)  # dropout masks: the same stream in every run with this seed
        random.seed(config.seed)

    def _lr_factor(self, step: int) -> float:
        c = self.config
        return learning_rate(step, c.lr, c.steps, c.warmup_steps, c.min_lr, c.schedule) / c.lr

    @property
    def tokens_per_step(self) -> int:
        """Tokens an optimizer step reads from a token stream (chat batches: at most this, padding included)."""
        return self.config.batch_size * self.config.grad_accum_steps * self.context_length

    def train_step(self) -> dict:
        """One optimizer step over `grad_accum_steps` micro-batches."""
        start = time.perf_counter()
        self.model.train()
        micro = [tuple(t.to(self.device, non_blocking=True) for t in self.batches.next())
                 for _ in range(self.config.grad_accum_steps)]
        lr = self.optimizer.param_groups[0]["lr"]
        tokens = sum(x.numel() for x, _ in micro)
        result = self.training_step(micro)
        loss, grad_norm = result.loss, result.grad_norm
        if result.stepped:  # the schedule counts updates: a step the GradScaler skipped moves neither
            self.scheduler.step()
        self.step += 1
        synchronize(self.device)
        record = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tokens / (time.perf_counter() - start)}
        for key, value in record.items():
            self.history[key].append(value)
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per target token on the fixed validation batches (no dropout)."""
        if self.val is None:
            raise ValueError("this Trainer has no validation data; pass val")
        was_training = self.model.training
        self.model.eval()
        total, count = 0.0, 0
        for x, y in self.val:
            x = x.to(self.device)
            with self.precision.autocast():
                logits = self.model(x)
            total += token_loss_sum(logits, y.to(self.device)).item()
            count += int((y != IGNORE_INDEX).sum())
        self.model.train(was_training)
        loss = total / count
        self.history["val_step"].append(self.step)
        self.history["val_loss"].append(loss)
        return loss

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None,
               sampling: Sampling = SAMPLE_SAMPLING) -> str:
        """A continuation of the prompt, drawn with its own generator so training's random streams are untouched."""
        if self.tokenizer is None:
            raise ValueError("sampling needs a tokenizer: pass tokenizer=helpers.get_tokenizer() to the Trainer")
        prompt = self.config.sample_prompt if prompt is None else prompt
        ids = torch.tensor([self.tokenizer.encode(prompt)], device=self.device)
        generator = torch.Generator(self.device).manual_seed(self.config.seed)
        with self.precision.autocast():
            out = self.model.generate(ids, max_new_tokens or self.config.sample_tokens, sampling, generator)
        text = self.tokenizer.decode(out[0, ids.size(1):].tolist())
        self.history["samples"].append((self.step, text))
        return text

    def fit(self, until_step: int | None = None, progress: bool = True) -> dict:
        """Train up to optimizer step `until_step` (default: the whole run), evaluating, sampling and
        checkpointing at the configured intervals; returns the history."""
        c = self.config
        until_step = c.steps if until_step is None else until_step
        if not self.step <= until_step <= c.steps:
            raise ValueError(f"until_step must be in [{self.step} (done), {c.steps} (the run's length)], "
                             f"got {until_step}")
        bar = _progress(range(self.step, until_step), progress, "train")
        for _ in bar:
            record = self.train_step()
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.1e}", refresh=False)
            last = self.step == c.steps
            if self.val is not None and ((c.eval_interval and self.step % c.eval_interval == 0) or last):
                self.evaluate()
            if self.tokenizer is not None and c.sample_interval and (self.step % c.sample_interval == 0 or last):
                self.sample()
            if c.checkpoint_path and ((c.checkpoint_interval and self.step % c.checkpoint_interval == 0) or last):
                self.save(c.checkpoint_path)
        return self.history

    def run_key(self) -> str:
        """What decides this run's weights, hashed: the initial weights, the recipe, the precision, the training
        tokens, the device type, torch's version and thread count (another machine or thread count rounds
        differently). Only before the first step: the weights are the initial ones then."""
        if self.step != 0:
            raise ValueError(f"run_key hashes the initial weights: ask before training (this run is at step "
                             f"{self.step})")
        weights = hashlib.sha256()
        for name, tensor in self.model.state_dict().items():
            weights.update(name.encode())
            weights.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        recipe = {key: value for key, value in asdict(self.config).items()
                  if key not in ("eval_interval", "eval_batches", "sample_interval", "sample_prompt", "sample_tokens",
                                 "checkpoint_path", "checkpoint_interval", "device")}
        what = dict(model=asdict(self.model.config), weights=weights.hexdigest(), recipe=recipe,
                    precision=self.precision.name, tokens=self.batches.tokens_sha256, device=self.device.type,
                    torch=torch.__version__, threads=torch.get_num_threads())
        if self.loss != FULL:  # (the default leaves the keys of earlier runs as they were)
            if not isinstance(self.loss, FullLoss | ChunkedLoss | RouterLoss):
                raise ValueError(f"a run trained with {type(self.loss).__name__} cannot be matched to an earlier one "
                                 "by its settings (what else it holds, a teacher's weights, would have to be hashed "
                                 "too): train it with fit()")
            what["loss"] = repr(self.loss)
        return hashlib.sha256(repr(sorted(what.items())).encode()).hexdigest()[:16]

    def run_path(self, name: str, directory: str | Path | None = None) -> Path:
        """Where this run, finished, is kept for reuse: `directory/name-<run_key>.pt` (default directory: the
        course's cache, `runs/`). Ask before the first step."""
        return Path(directory or cache_dir() / "runs") / f"{name}-{self.run_key()}.pt"

    def fit_or_reuse(self, name: str, directory: str | Path | None = None, progress: bool = True) -> dict:
        """The finished run: loaded from `run_path(name, directory)` when an earlier run with exactly these initial
        weights, recipe, data and machine saved it there (a later notebook reuses notebook 01's model instead of
        training it again), else trained from here and saved there. Evaluation and sampling intervals do not change
        the weights, so they may differ. Call it before the first step. Returns the history."""
        path = self.run_path(name, directory)
        if path.is_file():
            self.load(path)
        self.fit(progress=progress)
        if not path.is_file():
            self.save(path)
        return self.history

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "model_config": asdict(self.model.config),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "data": self.batches.state_dict(), "rng": _rng_states(),
                "step": self.step, "train_config": asdict(self.config), "precision": self.precision.name,
                "history": self.history}

    def save(self, path: str | Path) -> Path:
        """Write a checkpoint atomically (temporary file, then rename; with a .sha256 file): a crash while
        saving leaves the previous checkpoint intact."""
        return save_checkpoint(self.state_dict(), path)

    def load(self, path: str | Path) -> int:
        """Restore everything `save` wrote; returns the step to continue from."""
        state = load_checkpoint(path, map_location=self.device)
        if state["model_config"] != asdict(self.model.config):
            raise CheckpointError(f"{path} holds a model with config {state['model_config']}, this model has "
                                  f"{asdict(self.model.config)}: build the model from the checkpoint's config")
        mine = asdict(self.config)
        for key in ("steps", "batch_size", "grad_accum_steps", "lr", "min_lr", "warmup_steps", "schedule", "seed"):
            if state["train_config"][key] != mine[key]:
                raise CheckpointError(f"{path} was trained with {key} = {state['train_config'][key]}, this run has "
                                      f"{mine[key]}: an exact resume needs the same TrainConfig")
        if state.get("precision", self.precision.name) != self.precision.name:
            raise CheckpointError(f"{path} was trained in {state['precision']}, this run computes in "
                                  f"{self.precision.name}: an exact resume needs the same precision")
        self.batches.load_state_dict(state["data"])  # first: it refuses other data before anything is replaced
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        _set_rng_states(state["rng"])
        self.step = state["step"]
        self.history = {key: list(value) for key, value in state["history"].items()}
        return self.step


def _progress(steps: range, enabled: bool, desc: str):
    if not enabled:
        return steps
    from tqdm import tqdm

    return tqdm(steps, desc=desc, initial=steps.start, total=steps.stop)


def plot_history(history: dict, ax=None, label: str = "", lr_axis: bool = True):
    """Training loss per step, validation loss at its evaluations and (on a second axis) the learning rate."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    prefix = f"{label} " if label else ""
    (line,) = ax.plot(history["step"], history["loss"], alpha=0.6, label=f"{prefix}train")
    if history["val_step"]:
        ax.plot(history["val_step"], history["val_loss"], "o-", color=line.get_color(), label=f"{prefix}val")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    handles, labels = ax.get_legend_handles_labels()  # lines drawn on ax before (a baseline) are kept
    top = ax
    if lr_axis:
        top = ax.twinx()
        top.plot(history["step"], history["lr"], color="grey", linestyle=":", label="learning rate")
        top.set_ylabel("learning rate")
        more_handles, more_labels = top.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    top.legend(handles, labels, loc="upper right")  # on the top axis, so no line is drawn over it
    return ax
