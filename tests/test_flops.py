"""FLOPs counted by hand against fvcore and FlopCounterMode; MFU, the roofline, throughput and the CLI."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.__main__ import main
from helpers.measure.flops import (
    count_with_flop_counter,
    count_with_fvcore,
    flop_counter_flops,
    forward_flops,
    fvcore_flops,
    linear_layer_flops,
    training_step_flops,
)
from helpers.measure.mfu import (
    datasheet_peak_flops,
    measure_throughput,
    mfu,
    peak_flops,
)
from helpers.measure.roofline import gpt_operations, roofline, time_operation

ROOT = Path(__file__).resolve().parents[1]
GPT2 = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"]
TINY = GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=3, dropout=0.0)


def test_forward_flops_of_gpt2_small_by_hand():
    f = forward_flops(GPTConfig.from_preset("gpt2-small"), batch=2, seq=1024)
    tokens, d, layers, heads, head_dim = 2048, 768, 12, 12, 64
    assert f.qkv == layers * 2 * tokens * d * 3 * d
    assert f.attn_out == layers * 2 * tokens * d * d
    assert f.mlp == layers * 2 * (2 * tokens * d * 4 * d)
    assert f.attention_scores == f.attention_values == layers * 2 * heads * 2 * 1024 * 1024 * head_dim
    assert f.attention_scores_causal == layers * 2 * heads * 2 * (1024 * 1025 // 2) * head_dim
    assert f.lm_head == 2 * tokens * d * 50257
    assert f.total() == 583_296_614_400  # the ~5.83e11 of the course design
    assert f.per_token() == f.total() / tokens
    assert f.total(causal=True) == f.total() - f.attention() + f.attention(causal=True)


def test_linear_layers_only_is_the_sources_count():
    """The popular 5.1e11 ... 6.4e12 (thop, batch 2 x 1024, doubled to 2 per multiply-add): nn.Linear only."""
    source = {"gpt2-small": 5.1e11, "gpt2-medium": 1.4e12, "gpt2-large": 3.2e12, "gpt2-xl": 6.4e12}
    for name, quoted in source.items():
        config = GPTConfig.from_preset(name)
        f = forward_flops(config, 2, 1024)
        linear = linear_layer_flops(config, 2, 1024)
        assert linear == f.weights + f.lm_head == f.total() - f.attention()
        assert f"{linear:.1e}" == f"{quoted:.1e}"


# GPT-2 small and the course's own sizes in every run; the larger GPT-2 sizes (the same code, wider and deeper) with
# the slow tier
REPRESENTATIVE_PRESETS = ("gpt2-small", "gpt-cpu", "gpt-smoke")


@pytest.mark.parametrize("name", [name if name in REPRESENTATIVE_PRESETS else pytest.param(name, marks=pytest.mark.slow)
                                  for name in [*GPT2, "gpt-cpu", "gpt-smoke"]])
def test_three_counters_agree_for_every_preset(name):
    config = GPTConfig.from_preset(name)
    seq = min(1024, config.context_length)
    analytic = forward_flops(config, 2, seq)
    for count in (fvcore_flops(config, 2, seq), flop_counter_flops(config, 2, seq)):
        assert count.total == pytest.approx(analytic.total(), rel=0.01), count.counter
        for part, flops in analytic.by_part().items():
            assert count.by_part()[part] == pytest.approx(flops, rel=0.01), (count.counter, part)
        # what each counter missed is exactly the attention matmuls, and nothing else
        assert count.raw == pytest.approx(analytic.total() - analytic.attention(), rel=0.01)
        assert sum(count.missed.values()) == pytest.approx(analytic.attention(), rel=0.01)


@pytest.mark.parametrize("fields", [{}, {"ffn_type": "swiglu"}, {"bias": False, "tie_weights": False}])
def test_fvcore_from_one_block_equals_tracing_the_whole_model(fields):
    config = dataclasses.replace(TINY, **fields)
    torch.manual_seed(0)
    idx = torch.randint(0, config.vocab_size, (3, 20))
    whole = count_with_fvcore(GPT(config), idx)
    scaled = fvcore_flops(config, 3, 20)
    assert scaled.total == whole.total == forward_flops(config, 3, 20).total()
    assert scaled.by_module == whole.by_module
    assert scaled.by_operator == whole.by_operator
    assert scaled.missed == whole.missed


def test_fvcore_by_itself_skips_sdpa():
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(GPT(TINY).eval(), torch.zeros(1, 8, dtype=torch.long))
    analysis.unsupported_ops_warnings(False).total()
    assert analysis.unsupported_ops()["aten::scaled_dot_product_attention"] == TINY.n_layers


def test_flop_counter_on_fake_tensors_equals_real_ones_forward_and_backward():
    torch.manual_seed(0)
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    for backward in (False, True):
        real = count_with_flop_counter(GPT(TINY), idx, backward=backward)
        fake = flop_counter_flops(TINY, 2, 16, backward=backward)
        assert real.total == fake.total and real.missed == fake.missed and real.by_module == fake.by_module
    assert set(real.missed) == {"aten::_scaled_dot_product_flash_attention_for_cpu",
                                "aten::_scaled_dot_product_flash_attention_for_cpu_backward"}


def test_eager_attention_is_counted_by_pytorch_itself_and_training_is_three_forwards():
    """Eager attention runs plain bmm, which FlopCounterMode knows: an independent check of the formulas."""
    model = GPT(TINY, attn_implementation="eager")
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    forward = count_with_flop_counter(model, idx)
    assert forward.missed == {} and forward.total == forward_flops(TINY, 2, 16).total()
    step = count_with_flop_counter(model, idx, backward=True)
    assert step.total == 3 * forward.total == training_step_flops(TINY, 2, 16)


@pytest.mark.parametrize("name", ["gpt-smoke", "gpt2-small"])
def test_sdpa_training_step_adds_the_recomputed_scores(name):
    config = GPTConfig.from_preset(name)
    counted = flop_counter_flops(config, 2, 64, backward=True).total
    assert counted == training_step_flops(config, 2, 64, recompute_attention=True)
    assert counted - training_step_flops(config, 2, 64) == forward_flops(config, 2, 64).attention_scores


@pytest.mark.parametrize("name", GPT2)
def test_swiglu_keeps_the_flops_of_the_gelu_mlp(name):
    gelu = forward_flops(GPTConfig.from_preset(name), 1, 128)
    swiglu = forward_flops(GPTConfig.from_preset(name, ffn_type="swiglu"), 1, 128)
    assert swiglu.mlp == pytest.approx(gelu.mlp, rel=0.01)
    config = dataclasses.replace(TINY, ffn_type="swiglu")
    assert flop_counter_flops(config, 2, 16).total == forward_flops(config, 2, 16).total()


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="exceeds the model's context length 32; use seq <= 32"):
        forward_flops(TINY, 1, 33)
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        forward_flops(TINY, 0, 8)


# ---- peaks and MFU ----


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312), ("NVIDIA A100 80GB PCIe", torch.float16, 312),
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4), ("NVIDIA H100 PCIe", torch.bfloat16, 756),
    ("NVIDIA H100 NVL", torch.bfloat16, 835.5), ("NVIDIA H200", torch.bfloat16, 989.4),
    ("NVIDIA H200 NVL", torch.bfloat16, 835.5), ("NVIDIA L4", torch.bfloat16, 121),
    ("NVIDIA A10G", torch.bfloat16, 70), ("NVIDIA A10", torch.bfloat16, 125),
    ("Tesla T4", torch.float16, 65), ("Tesla T4", None, 8.1), ("Tesla T4", torch.bfloat16, None),
    ("Tesla V100-SXM2-16GB", torch.float16, 125), ("Tesla V100-PCIE-32GB", torch.float16, 112),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156), ("NVIDIA GeForce RTX 4090", torch.bfloat16, None),
])
def test_datasheet_peaks_by_device_name(name, dtype, tflops):
    peak = datasheet_peak_flops(name, dtype)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_mfu_of_a_gpt2_small_step_by_hand():
    step = training_step_flops(GPTConfig.from_preset("gpt2-small"), 2, 1024)
    assert step == 3 * 583_296_614_400
    peak = peak_flops("NVIDIA A100-SXM4-40GB", "cuda", torch.bfloat16)
    assert peak.source == "datasheet (A100, bfloat16)"
    assert mfu(step / 0.025, peak.flops) == pytest.approx(1_749_889_843_200 / 0.025 / 312e12)
    with pytest.raises(ValueError, match="peak must be positive"):
        mfu(1e12, 0)


def test_peak_is_measured_where_no_datasheet_applies():
    for name, device_type in (("Intel Xeon", "cpu"), ("NVIDIA GeForce RTX 4090", "cuda"), ("Tesla T4", "cuda")):
        peak = peak_flops(name, device_type, torch.bfloat16, measure=lambda: 4.2e12)
        assert peak.flops == 4.2e12 and peak.source.startswith("measured")


def test_roofline_by_hand():
    peak, bandwidth = 100e12, 2e12  # ridge point at 50 FLOP/byte
    assert roofline(10, peak, bandwidth) == 20e12
    assert roofline(50, peak, bandwidth) == peak == roofline(500, peak, bandwidth)


def test_operations_flops_and_bytes_by_hand():
    config = GPTConfig.from_preset("gpt2-small")
    ops = {op.name: op for op in gpt_operations(config, 2, 1024)}
    f = forward_flops(config, 2, 1024)
    assert ops["QKV projection"].flops * 12 == f.qkv
    assert ops["LM head"].flops == f.lm_head
    assert ops["Q·Kᵀ scores (eager, writes T×T)"].flops * 12 == f.attention_scores
    assert ops["SDPA causal attention (fused)"].flops * 12 == f.attention(causal=True)
    qkv_bytes = (2048 * 768 + 768 * 2304 + 2048 * 2304) * 4
    assert ops["QKV projection"].intensity == 2 * 2048 * 768 * 2304 / qkv_bytes
    assert ops["residual add"].intensity == 1 / 12  # 1 FLOP per element, 3 float32 moved
    # eager Q·Kᵀ writes the T x T scores; fused attention only reads Q, K, V and writes the output
    assert ops["Q·Kᵀ scores (eager, writes T×T)"].intensity == 2 * 1024 * 1024 * 64 / ((2 * 1024 * 64 + 1024**2) * 4)
    assert ops["SDPA causal attention (fused)"].intensity == (1024 + 1) / 8


def test_every_operation_runs():
    for op in gpt_operations(TINY, 2, 16, dtype=torch.bfloat16):
        assert 0 < time_operation(op, rounds=2).median < math.inf, op.name


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_throughput_counts_tokens_and_model_flops(mode):
    torch.manual_seed(0)
    model = GPT(TINY)
    before = model.lm_head.weight.detach().clone()
    t = measure_throughput(model, mode, batch=2, seq=16, min_run_time=0.01)
    assert t.tokens_per_s == pytest.approx(32 / t.seconds)
    q1, q3 = t.seconds_iqr
    assert 0 < q1 <= t.seconds <= q3
    flops = training_step_flops(TINY, 2, 16) if mode == "train" else forward_flops(TINY, 2, 16).total()
    assert t.flops_per_step == flops and t.flops_per_s == pytest.approx(flops / t.seconds)
    assert torch.equal(model.lm_head.weight, before) == (mode == "forward")  # a training step updates weights
    with pytest.raises(ValueError, match="valid modes: forward, train"):
        measure_throughput(model, "backward", 2, 16)


# ---- command line and GPU script ----


def test_cli_json_reports_the_three_counters(python_process):
    done = python_process("-m", "helpers", "flops", "--model", "gpt2-small", "--batch", "2", "--ctx", "1024", "--json",
                          check=True, cwd=ROOT)
    report = json.loads(done.stdout)
    assert report["analytic"] == 583_296_614_400
    assert report["fvcore"] == pytest.approx(report["analytic"], rel=0.01)
    assert report["flop_counter"] == pytest.approx(report["analytic"], rel=0.01)
    assert report["fvcore_raw"] == report["flop_counter_raw"] == report["linear_layers_only"] < report["analytic"]
    assert sum(report["breakdown"][k] for k in ("qkv", "attn_out", "mlp", "attention_scores", "attention_values",
                                                 "lm_head")) == report["analytic"]
    assert report["training_step"] == 3 * report["analytic"] and report["parameters"] == 124_439_808


def test_cli_text(capsys):
    assert main(["flops", "--model", "gpt-smoke", "--batch", "1"]) == 0
    assert "fvcore" in capsys.readouterr().out


def test_gpu_benchmark_script_runs_in_smoke_mode(chapter_script, tmp_path):
    chapter_script("ch04_flops/gpu_benchmark.py").main(["--smoke", "--out", str(tmp_path)])
    (result,) = tmp_path.glob("flops_*.json")
    run = json.loads(result.read_text())
    assert run["smoke"] and [r["preset"] for r in run["presets"]] == ["gpt-smoke"]
    row = run["presets"][0]
    assert row["status"] == "ok" and row["batch_size"] == 4 and row["batch_search"]["limit_reached"]
    assert 0 < row["train"]["mfu"] and row["train"]["flops_per_step"] == training_step_flops(
        GPTConfig.from_preset("gpt-smoke"), row["batch_size"], row["seq"])
    assert {op["name"] for op in run["roofline"]["operations"]} >= {"LM head", "GELU"}
    assert list(tmp_path.glob("flops_*.png"))


def test_gpu_benchmark_reports_a_preset_that_does_not_fit(chapter_script, monkeypatch):
    from helpers.measure.batch_size import BatchSizeError

    script = chapter_script("ch04_flops/gpu_benchmark.py")

    def nothing_fits(fits, limit):
        raise BatchSizeError("batch size 1 does not fit: use a smaller model")

    monkeypatch.setattr(script, "largest_batch_size", nothing_fits)
    row = script.bench_preset("gpt-smoke", 16, 2, None, 0.01, 1e12, 1e12, torch.device("cpu"))
    assert row == {"preset": "gpt-smoke", "seq": 16, "status": "does not fit: batch size 1 does not fit: use a "
                                                                  "smaller model"}
