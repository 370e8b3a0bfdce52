"""The training loop: exact gradient accumulation, learning-rate schedules, precision choice, data order and an
exact resume from an atomic checkpoint."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.system.device import REFERENCE_DEVICES, UnsupportedDtypeError
from helpers.system.virtual_device import on_accelerator, virtual_accelerator
from helpers.training.checkpoint import CheckpointError, checksum_path
from helpers.training.lr_schedule import learning_rate
from helpers.training.step import FULL, IGNORE_INDEX, ChunkedLoss, DistillationLoss, FullLoss, accumulate_gradients
from helpers.training.trainer import ShuffledBatches, TrainConfig, Trainer, resolve_precision

TINY = GPTConfig(vocab_size=97, context_length=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0)


def tiny_gpt(seed=0, dropout=0.0, dtype=torch.float32):
    torch.manual_seed(seed)
    config = GPTConfig(**{**TINY.__dict__, "dropout": dropout})
    return GPT(config).to(dtype)


def token_stream(n=2000, seed=0):
    """A learnable stream: a noisy repeating pattern over the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(n) * 7 % TINY.vocab_size
    noise = torch.randint(0, TINY.vocab_size, (n,), generator=g)
    return torch.where(torch.rand(n, generator=g) < 0.1, noise, base)


# ---------------------------------------------------------------- learning-rate schedule


def test_warmup_is_linear_and_reaches_the_peak():
    lrs = [learning_rate(s, 1e-3, 100, warmup_steps=10, min_lr=1e-4) for s in range(10)]
    assert lrs == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decay_goes_from_peak_to_min_lr(schedule):
    total, warmup, peak, floor = 110, 10, 1e-3, 1e-4
    assert learning_rate(warmup, peak, total, warmup, floor, schedule) == pytest.approx(peak)
    middle = learning_rate(warmup + 50, peak, total, warmup, floor, schedule)
    assert middle == pytest.approx((peak + floor) / 2)  # both schedules pass the midpoint halfway
    quarter = learning_rate(warmup + 25, peak, total, warmup, floor, schedule)
    expected = floor + (peak - floor) * (0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75)
    assert quarter == pytest.approx(expected)
    assert learning_rate(total, peak, total, warmup, floor, schedule) == pytest.approx(floor)
    assert learning_rate(total + 50, peak, total, warmup, floor, schedule) == pytest.approx(floor)


def test_constant_schedule_and_bad_settings():
    assert learning_rate(50, 1e-3, 100, 10, 0.0, "constant") == 1e-3
    for kwargs, words in [({"schedule": "step"}, "unknown schedule"), ({"warmup_steps": 200}, "warmup_steps"),
                          ({"min_lr": 1.0}, "min_lr"), ({"max_lr": 0.0}, "positive")]:
        args = {"step": 0, "max_lr": 1e-3, "total_steps": 100} | kwargs
        with pytest.raises(ValueError, match=words):
            learning_rate(**args)


# ---------------------------------------------------------------- exact gradient accumulation


def padded_batch(seed=1):
    """4 sequences whose numbers of target tokens differ a lot (the rest is IGNORE_INDEX padding)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TINY.vocab_size, (4, TINY.context_length), generator=g)
    y = torch.randint(0, TINY.vocab_size, (4, TINY.context_length), generator=g)
    for row, keep in enumerate([16, 14, 2, 1]):
        y[row, keep:] = IGNORE_INDEX
    return x, y


def gradients(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def full_batch_reference(model, x, y, autocast):
    model.zero_grad()
    with autocast():
        logits = model(x)
    F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).backward()
    return gradients(model)


def relative_error(a, b):
    num = math.sqrt(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a))
    return num / math.sqrt(sum(float(b[k].double().pow(2).sum()) for k in b))


AUTOCASTS = {
    "fp32": (lambda: torch.autocast("cpu", enabled=False), 1e-5),
    "bf16-autocast": (lambda: torch.autocast("cpu", dtype=torch.bfloat16), 1e-2),
}


@pytest.mark.parametrize("precision", AUTOCASTS)
@pytest.mark.parametrize("n_micro", [2, 4])
def test_accumulated_gradients_equal_the_full_batch(precision, n_micro):
    autocast, tol = AUTOCASTS[precision]
    model = tiny_gpt()
    x, y = padded_batch()
    reference = full_batch_reference(model, x, y, autocast)

    model.zero_grad()
    micro = list(zip(x.chunk(n_micro), y.chunk(n_micro), strict=True))
    loss, n_tokens = accumulate_gradients(model, micro, autocast)
    assert n_tokens == int((y != IGNORE_INDEX).sum())
    assert relative_error(gradients(model), reference) < tol

    # the pitfall, measured: averaging per-micro-batch means weights short micro-batches' tokens more
    model.zero_grad()
    for xm, ym in micro:
        with autocast():
            logits = model(xm)
        (F.cross_entropy(logits.float().flatten(0, 1), ym.flatten(), ignore_index=IGNORE_INDEX) / n_micro).backward()
    assert relative_error(gradients(model), reference) > 10 * tol


def test_accumulated_loss_is_the_token_mean_in_float64():
    model = tiny_gpt(dtype=torch.float64)
    x, y = padded_batch()
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX).item()
    loss, _ = accumulate_gradients(model, list(zip(x.chunk(4), y.chunk(4), strict=True)))
    assert loss == pytest.approx(expected, rel=1e-12)


def test_micro_batches_without_targets_are_refused():
    x, y = padded_batch()
    with pytest.raises(ValueError, match="no target tokens"):
        accumulate_gradients(tiny_gpt(), [(x, torch.full_like(y, IGNORE_INDEX))])


# ---------------------------------------------------------------- precision choice


@pytest.mark.parametrize("device, dtype, scaler", [
    ("cpu", torch.bfloat16, False), ("cpu-no-bf16", None, False), ("mps", torch.bfloat16, False),
    ("t4", torch.float16, True), ("a100", torch.bfloat16, False), ("h100", torch.bfloat16, False)])
def test_auto_precision_per_device(device, dtype, scaler):
    precision = resolve_precision("auto", REFERENCE_DEVICES[device])
    assert precision.dtype == dtype and precision.needs_scaler == scaler


def test_unsupported_precision_is_refused_with_an_alternative():
    with pytest.raises(UnsupportedDtypeError, match="float16 with torch.amp.GradScaler"):
        resolve_precision("bfloat16", REFERENCE_DEVICES["t4"])
    with pytest.raises(ValueError, match="unknown precision"):
        resolve_precision("int8", REFERENCE_DEVICES["cpu"])


# ---------------------------------------------------------------- data order


def test_each_epoch_visits_every_window_once_and_the_position_restores():
    ids = torch.arange(16 * 10 + 1)  # 10 windows of 16 tokens: window k starts at token 16k
    batches = ShuffledBatches(ids, batch_size=3, context_length=16, seed=5)
    assert batches.batches_per_epoch == 3  # 9 windows per epoch, the 10th dropped
    starts = [int(x[i, 0]) // 16 for _ in range(3) for x, _ in [batches.next()] for i in range(3)]
    assert len(set(starts)) == 9
    x, y = batches.next()  # next epoch: a different order
    assert torch.equal(y[:, :-1], x[:, 1:])
    state = batches.state_dict()
    expected = [batches.next()[0] for _ in range(4)]
    again = ShuffledBatches(ids, batch_size=3, context_length=16, seed=5)
    again.load_state_dict(state)
    assert all(torch.equal(again.next()[0], e) for e in expected)
    other = ShuffledBatches(ids, batch_size=3, context_length=16, seed=6)
    with pytest.raises(CheckpointError, match="seed"):
        other.load_state_dict(state)


# ---------------------------------------------------------------- the loop and exact resume


def make_trainer(tmp_path, precision="float32", seed=0, dropout=0.1, loss=FULL, **overrides):
    config = TrainConfig(**{"steps": 6, "batch_size": 4, "grad_accum_steps": 2, "lr": 3e-3, "min_lr": 3e-4,
                            "warmup_steps": 2, "eval_interval": 3, "eval_batches": 2, "precision": precision,
                            "checkpoint_path": str(tmp_path / "ckpt.pt"), "device": "cpu", "seed": 0} | overrides)
    ids = token_stream()
    return Trainer(tiny_gpt(seed, dropout), ids[:1600], ids[1600:], config, loss=loss)


@pytest.mark.parametrize("precision", ["float32", "float16"])  # float16: the GradScaler's state is resumed too
def test_resume_equals_an_uninterrupted_run(tmp_path, precision):
    straight = make_trainer(tmp_path / "a", precision)
    straight.fit(progress=False)

    first = make_trainer(tmp_path / "b", precision, checkpoint_interval=3)
    first.fit(until_step=3, progress=False)
    resumed = make_trainer(tmp_path / "c", precision, seed=123)  # other initial weights: the load must replace them
    assert resumed.load(tmp_path / "b" / "ckpt.pt") == 3
    resumed.fit(progress=False)

    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.history["loss"] == straight.history["loss"]
    assert resumed.history["val_loss"] == straight.history["val_loss"]
    if precision == "float16":
        assert resumed.scaler.is_enabled() and resumed.scaler.get_scale() == straight.scaler.get_scale()

    # and the check can fail: resuming at the wrong data position gives other weights
    wrong = make_trainer(tmp_path / "d", precision)
    wrong.load(tmp_path / "b" / "ckpt.pt")
    wrong.batches.index -= 1
    wrong.fit(progress=False)
    assert not torch.equal(wrong.model.lm_head.weight, straight.model.lm_head.weight)


def test_a_run_resumes_on_a_device_other_than_the_cpu(tmp_path):
    """Trainer.load maps a checkpoint onto the training device, its RNG states with it; torch restores those from
    the CPU only (on CUDA: "RNG state must be a torch.ByteTensor"). The virtual accelerator stands in for a GPU."""
    straight = make_trainer(tmp_path / "a")  # on the CPU, which computes what the accelerator computes
    straight.fit(progress=False)
    with virtual_accelerator() as device:
        first = make_trainer(tmp_path / "b", checkpoint_interval=3, device=str(device))
        first.fit(until_step=3, progress=False)
        resumed = make_trainer(tmp_path / "c", seed=123, device=str(device))
        assert resumed.load(tmp_path / "b" / "ckpt.pt") == 3
        resumed.fit(progress=False)
        assert all(on_accelerator(p) for p in resumed.model.parameters())
        assert resumed.history["loss"] == straight.history["loss"]
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(straight.model.parameters(),
                                                                  resumed.model.parameters(), strict=True))


def test_a_finished_run_is_reused_by_a_trainer_with_the_same_weights_recipe_and_data(tmp_path, monkeypatch):
    """fit_or_reuse trains once; a second Trainer with the same initial weights, recipe and data loads the weights
    instead, whatever its evaluation interval (which does not change the weights: checked against a run trained
    with another); other initial weights or another recipe train a run of their own."""
    runs = tmp_path / "runs"
    first = make_trainer(tmp_path / "a", eval_interval=3)
    key = first.run_key()
    first.fit_or_reuse("tiny", runs, progress=False)
    assert [p.name for p in runs.glob("*.pt")] == [f"tiny-{key}.pt"]
    with pytest.raises(ValueError, match="before training"):
        first.run_key()

    plain = make_trainer(tmp_path / "b", eval_interval=0)
    plain.fit(progress=False)
    reused = make_trainer(tmp_path / "c", eval_interval=0)
    assert reused.run_key() == key
    monkeypatch.setattr(reused, "train_step", lambda: pytest.fail("a finished run was trained again"))
    reused.fit_or_reuse("tiny", runs, progress=False)
    for (name, a), b, c in zip(first.model.state_dict().items(), plain.model.state_dict().values(),
                               reused.model.state_dict().values(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, c), name
    assert reused.step == 6 and reused.history["val_loss"][-1] == first.history["val_loss"][-1]

    others = [make_trainer(tmp_path / "d", seed=123), make_trainer(tmp_path / "e", lr=1e-3, min_lr=1e-4)]
    assert len({key, *(o.run_key() for o in others)}) == 3
    for other in others:
        other.fit_or_reuse("tiny", runs, progress=False)
        assert not torch.equal(other.model.lm_head.weight, first.model.lm_head.weight)
    assert len(list(runs.glob("*.pt"))) == 3


def test_training_lowers_the_validation_loss_and_follows_the_schedule(tmp_path):
    trainer = make_trainer(tmp_path, steps=40, eval_interval=20, dropout=0.0, lr=1e-2, min_lr=1e-3)
    before = trainer.evaluate()
    trainer.fit(progress=False)
    assert trainer.history["val_loss"][-1] < 0.7 * before
    assert trainer.history["lr"] == pytest.approx([learning_rate(s, 1e-2, 40, 2, 1e-3) for s in range(40)])
    assert all(0 < n for n in trainer.history["grad_norm"])


def test_gradient_clipping_bounds_the_update(tmp_path):
    clipped = make_trainer(tmp_path / "c", steps=1, warmup_steps=0, grad_clip=1e-3, dropout=0.0)
    free = make_trainer(tmp_path / "f", steps=1, warmup_steps=0, grad_clip=None, dropout=0.0)
    start = tiny_gpt().lm_head.weight.detach().clone()
    clipped.train_step()
    free.train_step()
    # with Adam, clipping rescales the first moment only: the first update is the same; the second moment
    # is not, so compare the stored first moments, which clipping shrinks to max_norm / norm of their size
    m_clip = clipped.optimizer.state[clipped.model.lm_head.weight]["exp_avg"]
    m_free = free.optimizer.state[free.model.lm_head.weight]["exp_avg"]
    norm = clipped.history["grad_norm"][0]
    assert torch.allclose(m_clip, m_free * (1e-3 / norm), rtol=1e-4, atol=1e-12)
    assert not torch.equal(clipped.model.lm_head.weight, start)


def test_sampling_does_not_change_training(tmp_path):
    from helpers.text.tokenizer import get_tokenizer

    plain = make_trainer(tmp_path / "p")
    plain.fit(progress=False)
    sampled = make_trainer(tmp_path / "s", sample_interval=2, sample_tokens=4, sample_prompt="a")  # "a": id 64
    sampled.tokenizer = get_tokenizer()
    sampled.fit(progress=False)
    assert [step for step, _ in sampled.history["samples"]] == [2, 4, 6]
    assert all(isinstance(text, str) and text for _, text in sampled.history["samples"])
    assert torch.equal(sampled.model.lm_head.weight, plain.model.lm_head.weight)
    assert sampled.history["loss"] == plain.history["loss"]


def test_checkpoints_are_atomic_checksummed_and_checked(tmp_path):
    trainer = make_trainer(tmp_path, steps=2, eval_interval=0)
    trainer.fit(progress=False)
    path = tmp_path / "ckpt.pt"
    assert path.is_file() and checksum_path(path).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name not in {"ckpt.pt", "ckpt.pt.sha256"}]  # no temporaries

    other_size = make_trainer(tmp_path, steps=2)
    other_size.model = GPT(GPTConfig(**{**TINY.__dict__, "d_model": 64}))
    with pytest.raises(CheckpointError, match="build the model from the checkpoint's config"):
        other_size.load(path)
    other_run = make_trainer(tmp_path, steps=2, lr=1e-3)
    with pytest.raises(CheckpointError, match="lr"):
        other_run.load(path)
    other_precision = make_trainer(tmp_path, "float16", steps=2)
    with pytest.raises(CheckpointError, match="trained in float32, this run computes in float16"):
        other_precision.load(path)
    # the same number of windows of other tokens: refused before any weight is replaced
    other_text = make_trainer(tmp_path, steps=2)
    ids = token_stream()
    other_text.batches = ShuffledBatches(ids[:1600].flip(0), 4, TINY.context_length, seed=0)
    before = other_text.model.lm_head.weight.clone()
    with pytest.raises(CheckpointError, match="tokens_sha256"):
        other_text.load(path)
    assert torch.equal(other_text.model.lm_head.weight, before)

    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt"):
        make_trainer(tmp_path, steps=2).load(path)


def test_bad_config_is_refused():
    for kwargs, words in [({"steps": 0}, "steps"), ({"grad_accum_steps": 0}, "grad_accum_steps"),
                          ({"precision": "fp8"}, "unknown precision"), ({"grad_clip": 0.0}, "grad_clip"),
                          ({"warmup_steps": 20}, "warmup_steps")]:
        with pytest.raises(ValueError, match=words):
            TrainConfig(**{"steps": 10} | kwargs)


def test_peak_memory_follows_the_micro_batch_not_the_effective_batch():
    from dataclasses import asdict

    from helpers.measure.memory import run_in_fresh_process

    config = asdict(GPTConfig(vocab_size=4096, context_length=64, d_model=128, n_heads=4, n_layers=2))

    def peak(micro, accum):
        return run_in_fresh_process("helpers.measure.batch_size:accumulation_peak_in_fresh_process", config=config,
                                    micro_batch=micro, accum_steps=accum, seq=64)

    one_batch, accumulated = peak(32, 1), peak(2, 16)  # the same 32 sequences per optimizer step
    assert accumulated < 0.7 * one_batch, (accumulated, one_batch)


def test_a_scaler_assigned_to_the_trainer_is_the_one_its_steps_use(tmp_path):
    """Notebook 03 starts a GradScaler too high to show it backing off: the steps must use that scaler."""
    trainer = make_trainer(tmp_path, "float16")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1)  # fp16 gradients overflow at 2^40
    trainer.scaler = scaler
    trainer.train_step()
    assert trainer.training_step.scaler is scaler
    assert scaler.get_scale() == 2.0**39  # the overflowing step was skipped and the scale halved


def test_a_step_the_scaler_skips_does_not_advance_the_schedule(tmp_path):
    """The learning-rate schedule counts updates: after a skipped fp16 step it stays where it was (and PyTorch's
    warning about `lr_scheduler.step()` before `optimizer.step()` is not raised); a step taken advances it."""
    trainer = make_trainer(tmp_path, "float16")
    c = trainer.config
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1)  # the first step overflows
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_step()
    assert trainer.scaler.get_scale() == 2.0**39 and trainer.scheduler.last_epoch == 0
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(learning_rate(0, c.lr, c.steps, c.warmup_steps,
                                                                                  c.min_lr, c.schedule))
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    trainer.train_step()
    assert trainer.scheduler.last_epoch == 1
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(learning_rate(1, c.lr, c.steps, c.warmup_steps,
                                                                                  c.min_lr, c.schedule))


# ---- the loss the Trainer takes ----


def test_the_trainer_minimises_the_loss_it_is_given_a_teachers_distribution(tmp_path):
    """One step's loss is the KL from the teacher to the model, averaged over every target token of the step's
    micro-batches (float64 reference on the same batches); a few steps bring the model's distribution closer."""
    teacher = tiny_gpt(seed=1).eval()
    trainer = make_trainer(tmp_path, dropout=0.0, loss=DistillationLoss(teacher), steps=8, warmup_steps=0)
    batches = copy.deepcopy(trainer.batches)
    micro = [batches.next() for _ in range(trainer.config.grad_accum_steps)]
    student64, teacher64 = copy.deepcopy(trainer.model).double(), copy.deepcopy(teacher).double()

    def mean_kl(student):
        with torch.no_grad():
            kls = [F.kl_div(F.log_softmax(student(x), -1), F.log_softmax(teacher64(x), -1), log_target=True,
                            reduction="none").sum(-1) for x, _ in micro]
        return torch.cat([k.flatten() for k in kls]).mean().item()

    before = mean_kl(student64)
    assert trainer.train_step()["loss"] == pytest.approx(before, rel=1e-5)
    for _ in range(7):
        trainer.train_step()
    assert mean_kl(copy.deepcopy(trainer.model).double()) < 0.8 * before


def test_a_chunked_loss_trains_as_the_full_one(tmp_path):
    full = make_trainer(tmp_path, dropout=0.0)
    chunked = make_trainer(tmp_path, dropout=0.0, loss=ChunkedLoss(24))
    for _ in range(3):
        assert chunked.train_step()["loss"] == pytest.approx(full.train_step()["loss"], rel=1e-5)


def test_reuse_tells_runs_apart_by_their_loss_and_refuses_one_it_cannot_name(tmp_path):
    default = make_trainer(tmp_path).run_key()
    assert make_trainer(tmp_path, loss=FullLoss()).run_key() == default  # earlier runs keep their keys
    assert make_trainer(tmp_path, loss=ChunkedLoss(24)).run_key() != default
    with pytest.raises(ValueError, match="train it with fit"):
        make_trainer(tmp_path, loss=DistillationLoss(tiny_gpt(seed=1))).run_key()
