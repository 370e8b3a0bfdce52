"""The training-speed ladder: every rung trains correctly, transformers' GPT-2 is a true peer, the report holds up."""

import copy
import dataclasses
import json
import math
from statistics import median

import pytest
import torch
import torch.nn.functional as F

from helpers import GPT, GPTConfig
from helpers.__main__ import main
from helpers.measure import train_ladder
from helpers.measure.flops import training_step_flops
from helpers.measure.peer import peer_logits, transformers_peer
from helpers.measure.train_bench import bench_train
from helpers.measure.train_ladder import rung_tokens_per_s
from helpers.measure.train_report import plot_ladder
from helpers.measure.train_rungs import (
    LADDER,
    StepSettings,
    ladder_step,
    make_batches,
    padded_vocab_model,
    plan_ladder,
)
from helpers.model.hf_gpt2 import hf_names, is_conv1d
from helpers.system.device import REFERENCE_DEVICES, detect_capabilities

# A vocabulary that is not a multiple of 64, so the padding rung applies (97 -> 128).
TINY = GPTConfig(vocab_size=97, context_length=32, d_model=32, n_heads=4, n_layers=2, dropout=0.0)


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def reference_loss(model: GPT, batches) -> float:
    """Plain fp32 cross-entropy of `model` over the micro-batches: the reference every rung is checked against."""
    with torch.no_grad():
        return sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in batches) / len(batches)


# ---- the plan: a pure function of the device ----


def applied(rungs):
    return [r for r in rungs if r.settings is not None]


def test_every_rung_changes_one_setting_of_the_rung_before():
    rungs = plan_ladder(REFERENCE_DEVICES["a100"], batch=8, ctx=1024, accumulation=4)
    assert [r.name for r in rungs] == list(LADDER) and len(applied(rungs)) == len(LADDER)
    for before, after in zip(rungs, rungs[1:], strict=False):
        a, b = dataclasses.asdict(before.settings), dataclasses.asdict(after.settings)
        assert sum(a[k] != b[k] for k in a) == 1, after.name
    top = rungs[-1].settings
    assert (top.tf32, top.fused_adamw, top.autocast, top.attn_implementation, top.vocab_multiple,
            top.accumulation, top.compile, top.loss_chunk) == (True, True, "bfloat16", "sdpa", 64, 4, True, 128)


@pytest.mark.parametrize("device, skipped, autocast", [
    ("cpu", {"tf32"}, "bfloat16"),
    ("cpu-no-bf16", {"tf32", "autocast"}, None),
    ("mps", {"tf32"}, "bfloat16"),
    ("t4", {"tf32"}, "float16"),
    ("h100", set(), "bfloat16"),
])
def test_rungs_that_do_not_apply_are_skipped_with_a_reason(device, skipped, autocast):
    caps = REFERENCE_DEVICES[device]
    rungs = plan_ladder(caps, batch=2, ctx=64)
    assert {r.name for r in rungs if r.settings is None} == skipped
    for r in rungs:
        assert r.note  # what it does, or why not
    assert rungs[-1].settings.autocast == autocast
    if device == "t4":
        autocast_rung = next(r for r in rungs if r.name == "autocast")
        assert "GradScaler" in autocast_rung.note and autocast_rung.label == "fp16 autocast"
        assert "8.0" in next(r for r in rungs if r.name == "tf32").note


def test_the_chunked_head_splits_a_micro_batch_in_two_at_least():
    sizes = {(2, 64): 64, (4, 128): 128, (8, 1024): 128, (1, 3): 2}  # 128 tokens: GPT-2's vocabulary in 32 MiB
    for (batch, ctx), chunk in sizes.items():
        assert plan_ladder(REFERENCE_DEVICES["cpu"], batch, ctx)[-1].settings.loss_chunk == chunk
    assert plan_ladder(REFERENCE_DEVICES["cpu"], 1, 1)[-1].settings is None


def test_the_chunked_head_rung_makes_the_plain_heads_update():
    """The rung above torch.compile, eager here, in float64: the same loss and the same AdamW update as the plain
    head, with a padded vocabulary and accumulation."""
    s = StepSettings(batch=2, ctx=16, vocab_multiple=64, accumulation=2)
    batches = make_batches(TINY.vocab_size, s, "cpu", seed=3)
    models, losses = {}, {}
    for chunk in (None, 5):
        model = padded_vocab_model(tiny_model().double(), s.vocab_multiple)
        losses[chunk] = ladder_step(model, dataclasses.replace(s, loss_chunk=chunk), TINY.vocab_size)(batches).loss
        models[chunk] = model
    assert losses[5] == pytest.approx(losses[None], rel=1e-12)
    for (name, a), b in zip(models[None].named_parameters(), models[5].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_plan_stops_where_asked_and_skips_what_is_already_done():
    rungs = plan_ladder(REFERENCE_DEVICES["cpu"], 2, 64, accumulation=1, vocab_size=128, until="accumulation")
    assert [r.name for r in rungs] == list(LADDER[: LADDER.index("accumulation") + 1])
    assert {r.name for r in rungs if r.settings is None} == {"tf32", "pad_vocab", "accumulation"}
    with pytest.raises(ValueError, match="rungs, in order"):
        plan_ladder(REFERENCE_DEVICES["cpu"], 2, 64, until="warp_speed")


# ---- each rung's step against a plain fp32 reference ----


def test_each_eager_rung_trains_like_the_fp32_reference():
    """First-step loss of every rung equals the plain fp32 loss on the same weights and batches (bf16: within its
    rounding); fp32 rungs make the same update as torch's reference AdamW; every rung lowers the loss."""
    caps = detect_capabilities("cpu")
    for rung in applied(plan_ladder(caps, batch=2, ctx=16, accumulation=3, vocab_size=TINY.vocab_size,
                                    until="accumulation")):
        s = rung.settings
        model = tiny_model()
        reference = copy.deepcopy(model).set_attn_implementation(s.attn_implementation)
        if s.vocab_multiple > 1:
            model = padded_vocab_model(model, s.vocab_multiple)
        step = ladder_step(model.set_attn_implementation(s.attn_implementation), s, TINY.vocab_size, lr=3e-3)
        batches = make_batches(TINY.vocab_size, s, "cpu", seed=1)
        expected = reference_loss(reference, batches)
        first = step(batches).loss
        assert first == pytest.approx(expected, rel=1e-5 if s.autocast is None else 1e-2), rung.name
        if s.autocast is None:  # the update itself, against torch's reference AdamW (for-loop), in float64: Adam
            # turns a float32 rounding difference in a near-zero gradient into a different update
            ours64 = tiny_model().double()
            theirs64 = tiny_model().double().set_attn_implementation(s.attn_implementation)
            if s.vocab_multiple > 1:
                ours64 = padded_vocab_model(ours64, s.vocab_multiple)
            ladder_step(ours64.set_attn_implementation(s.attn_implementation), s, TINY.vocab_size, lr=3e-3)(batches)
            optimizer = torch.optim.AdamW(theirs64.parameters(), lr=3e-3, foreach=False)
            for x, y in batches:
                (F.cross_entropy(theirs64(x).flatten(0, 1), y.flatten()) / len(batches)).backward()
            optimizer.step()
            for (name, ours), theirs in zip(ours64.named_parameters(), theirs64.parameters(), strict=True):
                real = ours[tuple(slice(0, n) for n in theirs.shape)]  # a padded vocabulary's real rows
                torch.testing.assert_close(real, theirs, rtol=1e-10, atol=1e-12, msg=f"{rung.name}: {name}")
        losses = [step(batches).loss for _ in range(3)]
        assert losses[-1] < first - 0.05, rung.name


def gradients_at_the_step(step, batches) -> list[torch.Tensor]:
    """Run one training step; return the gradients the optimizer saw (captured just before it stepped)."""
    seen = []
    hook = step.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: seen.extend(p.grad.clone() for p in step.model.parameters()))
    step(batches)
    hook.remove()
    return seen


def test_accumulated_micro_batches_give_the_gradients_of_one_large_batch():
    """Where the claim lives: the gradient handed to the optimizer. Only the order of float32 sums differs, so each
    gradient agrees to float32 rounding relative to its own scale (a near-zero element may differ in every digit)."""
    settings = StepSettings(batch=2, ctx=16, accumulation=3)
    batches = make_batches(TINY.vocab_size, settings, "cpu", seed=2)
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    accumulated = gradients_at_the_step(ladder_step(tiny_model(), settings, TINY.vocab_size), batches)
    whole = gradients_at_the_step(
        ladder_step(tiny_model(), dataclasses.replace(settings, batch=6, accumulation=1), TINY.vocab_size), [(x, y)])
    for name, a, b in zip(dict(tiny_model().named_parameters()), accumulated, whole, strict=True):
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_accumulated_micro_batches_update_like_one_large_batch_in_float64():
    """The whole step (AdamW included). Adam divides by sqrt(v), so a float32 rounding difference in a near-zero
    gradient can change an update completely; in float64 that rounding is ~1e-16 and the updates agree to 1e-10."""
    settings = StepSettings(batch=2, ctx=16, accumulation=3)
    batches = make_batches(TINY.vocab_size, settings, "cpu", seed=2)
    accumulated, whole = tiny_model().double(), tiny_model().double()
    ladder_step(accumulated, settings, TINY.vocab_size)(batches)
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    ladder_step(whole, dataclasses.replace(settings, batch=6, accumulation=1), TINY.vocab_size)([(x, y)])
    start = tiny_model().double()
    for a, b, p0 in zip(accumulated.parameters(), whole.parameters(), start.parameters(), strict=True):
        assert not torch.equal(a, p0)  # the step did update the weights
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_padded_vocabulary_trains_exactly_like_the_original():
    """Same loss and gradients on the real rows (the padding rows get none), and the same losses over steps."""
    model = tiny_model()
    padded = padded_vocab_model(model, 64)
    assert padded.config.vocab_size == 128 and padded.lm_head.weight is padded.tok_emb.weight
    settings = StepSettings(batch=2, ctx=16, fused_adamw=True)
    batches = make_batches(TINY.vocab_size, settings, "cpu", seed=3)
    x, y = batches[0]
    losses = [F.cross_entropy(m(x)[..., : TINY.vocab_size].flatten(0, 1), y.flatten()) for m in (model, padded)]
    torch.testing.assert_close(losses[1], losses[0])
    for loss in losses:
        loss.backward()
    grad = padded.tok_emb.weight.grad
    torch.testing.assert_close(grad[: TINY.vocab_size], model.tok_emb.weight.grad)
    assert grad[TINY.vocab_size :].abs().max() == 0
    model.zero_grad(), padded.zero_grad()
    steps = [ladder_step(m, settings, TINY.vocab_size) for m in (model, padded)]
    trained = [[step(batches).loss for _ in range(4)] for step in steps]
    assert trained[1] == pytest.approx(trained[0], rel=1e-5)


# ---- transformers' GPT-2 as the peer ----


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_transformers_peer_has_our_loss_and_gradients(attn_implementation):
    model = tiny_model().set_attn_implementation(attn_implementation)
    peer = transformers_peer(model)
    assert peer.config._attn_implementation == attn_implementation and not peer.config.use_cache
    x, y = make_batches(TINY.vocab_size, StepSettings(batch=3, ctx=32), "cpu", seed=4)[0]
    ours = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    theirs = F.cross_entropy(peer_logits(peer, x).flatten(0, 1), y.flatten())
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    ours.backward()
    theirs.backward()
    peer_grads = {name.removeprefix("transformer."): p.grad for name, p in peer.named_parameters()}
    for name, p in model.named_parameters():
        hf = hf_names(TINY)[name]
        grad = peer_grads[hf].t() if is_conv1d(hf) else peer_grads[hf]
        torch.testing.assert_close(grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_transformers_peer_refuses_an_attention_it_does_not_have():
    with pytest.raises(ValueError, match="no attention implementation like 'einsum'"):
        transformers_peer(tiny_model(), "einsum")


# ---- the report ----


def check_report(report: dict) -> None:
    """What every report must satisfy: each measured rung's numbers agree with each other, the best rung is the
    fastest, and the ratios are what the comparison measured."""
    rungs = {r["name"]: r for r in report["rungs"]}
    assert list(rungs) == list(LADDER[: len(rungs)])
    for r in rungs.values():
        assert {"name", "label", "status", "note", "tokens_per_s", "mfu"} <= set(r) and r["note"]
        if r["status"] != "ok":
            assert r["tokens_per_s"] is None and r["mfu"] is None
            continue
        s = r["settings"]
        tokens = s["batch"] * s["ctx"] * s["accumulation"]
        assert len(r["step_ms_runs"]) == report["steps"] and r["step_ms"] == pytest.approx(median(r["step_ms_runs"]))
        rates = [tokens / (ms / 1e3) for ms in r["step_ms_runs"]]
        assert r["tokens_per_s"] == pytest.approx(median(rates))
        q1, q3 = r["tokens_per_s_iqr"]
        assert min(rates) <= q1 <= r["tokens_per_s"] <= q3 <= max(rates)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * report["flops_per_token"] / report["peak_flops"])
        assert math.isfinite(r["first_loss"]) and r["last_loss"] < r["first_loss"]
    best = max((r for r in rungs.values() if r["status"] == "ok"), key=lambda r: r["tokens_per_s"])
    c = report["transformers"]
    assert report["best_rung"] == best["name"] == c["best_rung"] and c["status"] == "ok"
    eager = c["ours_tokens_per_s"] / c["transformers_eager_tokens_per_s"]
    assert report["ratio_vs_transformers_eager"] == pytest.approx(eager)
    if best["settings"]["compile"]:
        compiled = c["ours_tokens_per_s"] / c["transformers_compiled_tokens_per_s"]
        assert report["ratio_vs_transformers"] == report["ratio_vs_transformers_compiled"] == pytest.approx(compiled)
        assert report["ratio_vs_transformers_is"] == "compiled"
    else:
        assert report["ratio_vs_transformers"] == report["ratio_vs_transformers_eager"]
        assert report["ratio_vs_transformers_is"] == "eager" and report["ratio_vs_transformers_compiled"] is None
    peer = "transformers_compiled" if best["settings"]["compile"] else "transformers_eager"
    (o1, o3), (p1, p3) = c["ours_tokens_per_s_iqr"], c[f"{peer}_tokens_per_s_iqr"]
    apart = o3 < p1 or p3 < o1
    assert ("no measurable difference" not in c["verdict"]) == apart, c["verdict"]
    # ours and the peer start from the same weights and train on the same batches: the same first loss
    for name, loss in c["first_loss"].items():
        assert loss == pytest.approx(c["first_loss"]["ours"], rel=1e-2), name


def test_bench_train_json_has_the_rungs_and_consistent_numbers(capsys):
    flags = ["--model", "gpt-smoke", "--batch", "2", "--ctx", "16", "--steps", "2", "--warmup", "1",
             "--until", "sdpa", "--device", "cpu", "--json"]
    assert main(["bench-train", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["model"], report["batch"], report["ctx"]) == ("gpt-smoke", 2, 16)
    assert report["flops_per_token"] == training_step_flops(GPTConfig.from_preset("gpt-smoke"), 2, 16) / 32
    assert [r["name"] for r in report["rungs"]] == list(LADDER[: LADDER.index("sdpa") + 1])
    assert report["rungs"][1]["status"] == "skipped"  # TF32 on a CPU
    check_report(report)


def test_a_rung_lies_within_the_quartiles_it_is_plotted_with(monkeypatch):
    """Two timed steps ten times apart: tokens over the median time falls below the first quartile of tokens/s (the
    plot's error bars were negative and matplotlib refused them); the median of tokens/s does not."""
    real = train_ladder.timed_rounds

    def uneven_rounds(steps, rounds, device):
        timed = real(steps, rounds, device)
        return {name: ([0.01 * 10**i for i in range(rounds)], losses) for name, (_, losses) in timed.items()}

    monkeypatch.setattr(train_ladder, "timed_rounds", uneven_rounds)
    ladder = train_ladder.Ladder(GPTConfig.from_preset("gpt-smoke"), batch=2, ctx=16, steps=2, warmup=1,
                                device="cpu", until="sdpa", model_name="gpt-smoke")
    ladder.climb()
    report = ladder.report()
    for r in (r for r in report["rungs"] if r["status"] == "ok"):
        q1, q3 = r["tokens_per_s_iqr"]
        assert q1 <= r["tokens_per_s"] <= q3 and q1 <= rung_tokens_per_s(r).median <= q3, r["label"]
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * report["flops_per_token"] / report["peak_flops"])
    plot_ladder(report)


@pytest.mark.parametrize("kwargs, message", [
    ({"ctx": 65}, "ctx=65 is outside 1..64"),
    ({"batch": 0}, "batch=0 must be 1 or more"),
    ({"warmup": 0}, "warmup=0 must be 1 or more"),
])
def test_bench_train_refuses_sizes_that_cannot_run(kwargs, message):
    sizes = {"batch": 2, "ctx": 16, "steps": 1, "warmup": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        bench_train("gpt-smoke", device="cpu", **sizes)


@pytest.mark.compile
def test_gpu_benchmark_script_runs_in_smoke_mode(chapter_script, tmp_path):
    """The GPU script's code path at tiny size on CPU: every rung, torch.compile included, and the peer race."""
    chapter_script("ch05_training/gpu_benchmark.py").main(["--smoke", "--out", str(tmp_path)])
    (result,) = tmp_path.glob("train_speed_*.json")
    report = json.loads(result.read_text())
    rungs = {r["name"]: r for r in report["rungs"]}
    assert list(rungs) == list(LADDER) and list(tmp_path.glob("train_speed_*.png"))
    assert rungs["compile"]["status"] == rungs["chunked_head"]["status"] == "ok"
    # compiled: the same first loss as the eager rung below it (same weights, batches and precision)
    assert rungs["compile"]["first_loss"] == pytest.approx(rungs["accumulation"]["first_loss"], rel=1e-3)
    assert rungs["chunked_head"]["first_loss"] == pytest.approx(rungs["compile"]["first_loss"], rel=1e-3)
    check_report(report)
