"""The chapters' GPU benchmark scripts keep what they measured on a borrowed GPU: an item that fails (out of memory,
a kernel the GPU lacks) is recorded in the JSON and the run goes on, and the JSON is rewritten after every item, so
a run that stops early keeps the items before. Driven in-process on CPU at smoke size, with items made to fail."""

import json
import subprocess
import weakref
from pathlib import Path

import pytest
import torch

from helpers.measure import train_bench, train_ladder, train_peer, train_report, train_rungs
from helpers.measure.batch_size import BatchSizeError
from helpers.model.config import PRESETS
from helpers.system.device import REFERENCE_DEVICES


def written(out: Path) -> dict:
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())


# ---- ch03: attention ----


@pytest.mark.parametrize("device, dtype", [("t4", "float16"), ("a100", "bfloat16"), ("h100", "bfloat16"),
                                           ("cpu-no-bf16", "float32")])
def test_attention_benchmark_runs_in_the_gpus_native_half_precision(chapter_script, device, dtype):
    """bf16 on a T4 is emulated, and SDPA's fused kernels refuse it below sm_80 (SDPA would time its math kernel)."""
    assert chapter_script("ch03_attention/gpu_benchmark.py").default_dtype(REFERENCE_DEVICES[device]) == dtype


@pytest.mark.compile  # the script's compiled mode
def test_attention_benchmark_records_a_failing_item_and_goes_on(chapter_script, tmp_path, monkeypatch):
    script = chapter_script("ch03_attention/gpu_benchmark.py")
    bench, make_step = script.bench_attention, script.make_step

    def bench_attention(batch, seq, d_model, heads, dtype, device, mode, *args, **kwargs):
        if mode == "fwd" and batch > 1:  # the first item
            raise RuntimeError("CUDA error: misaligned address")
        return bench(batch, seq, d_model, heads, dtype, device, mode, *args, **kwargs)

    def failing_make_step(name, *args, **kwargs):  # a failure that is not out of memory, in the longest-sequence search
        if name == "sdpa_mask":
            raise ValueError("no kernel for this mask")
        return make_step(name, *args, **kwargs)

    monkeypatch.setattr(script, "bench_attention", bench_attention)
    monkeypatch.setattr(script, "make_step", failing_make_step)
    script.main(["--smoke", "--out", str(tmp_path)])
    run = written(tmp_path)
    assert run["errors"] == {"modes fwd": "RuntimeError: CUDA error: misaligned address",
                             "max_seq sdpa_mask": "ValueError: no kernel for this mask"}
    assert set(run["modes"]) == {"fwdbwd", "compiled"} and run["seq_sweep"]["fwd"] and run["seq_sweep"]["fwdbwd"]
    assert run["max_seq"]["eager"] == run["max_seq"]["sdpa"] == 128 and "sdpa_mask" not in run["max_seq"]
    assert list(tmp_path.glob("attention_*.png"))


@pytest.mark.compile
def test_attention_benchmark_saves_after_every_item(chapter_script, tmp_path, monkeypatch):
    script = chapter_script("ch03_attention/gpu_benchmark.py")
    bench = script.bench_attention

    def bench_attention(batch, *args, **kwargs):
        if batch == 1:  # the sequence sweep, after the three modes: the session ends here
            raise KeyboardInterrupt
        return bench(batch, *args, **kwargs)

    monkeypatch.setattr(script, "bench_attention", bench_attention)
    with pytest.raises(KeyboardInterrupt):
        script.main(["--smoke", "--out", str(tmp_path)])
    run = written(tmp_path)
    assert set(run["modes"]) == {"fwd", "fwdbwd", "compiled"} and not run["errors"]


# ---- ch04: FLOPs and MFU ----


def test_flops_benchmark_records_a_failing_preset_and_operation_and_goes_on(chapter_script, tmp_path, monkeypatch):
    script = chapter_script("ch04_flops/gpu_benchmark.py")
    bench_preset, time_operation = script.bench_preset, script.time_operation

    def failing_bench_preset(name, *args, **kwargs):
        if name == "gpt-cpu":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return bench_preset(name, *args, **kwargs)

    def failing_time_operation(op, **kwargs):
        if op.name == "GELU":
            raise RuntimeError("no kernel image is available for execution on the device")
        return time_operation(op, **kwargs)

    monkeypatch.setattr(script, "bench_preset", failing_bench_preset)
    monkeypatch.setattr(script, "time_operation", failing_time_operation)
    script.main(["--smoke", "--models", "gpt-cpu", "gpt-smoke", "--max-batch", "1", "--out", str(tmp_path)])
    run = written(tmp_path)
    assert [(r["preset"], r["status"]) for r in run["presets"]] == [
        ("gpt-cpu", "RuntimeError: CUDA error: an illegal memory access was encountered"), ("gpt-smoke", "ok")]
    assert set(run["errors"]) == {"preset gpt-cpu", "roofline GELU"}
    names = [op["name"] for op in run["roofline"]["operations"]]
    assert names and "GELU" not in names and list(tmp_path.glob("flops_*.png"))


# ---- ch05: the training-speed ladder ----


def fail_rungs(monkeypatch, error: BaseException, when) -> None:
    """Make the rungs whose settings satisfy `when` raise `error` as their training step is built."""
    ladder_step = train_ladder.ladder_step

    def failing(model, settings, *args, **kwargs):
        if when(settings):
            raise error
        return ladder_step(model, settings, *args, **kwargs)

    monkeypatch.setattr(train_ladder, "ladder_step", failing)


def test_training_benchmark_saves_after_every_rung(chapter_script, tmp_path, monkeypatch):
    fail_rungs(monkeypatch, KeyboardInterrupt(), lambda s: s.accumulation > 1)  # the session ends at that rung
    with pytest.raises(KeyboardInterrupt):
        chapter_script("ch05_training/gpu_benchmark.py").main(["--smoke", "--out", str(tmp_path)])
    report = written(tmp_path)
    assert [r["name"] for r in report["rungs"]] == list(train_rungs.LADDER[:train_rungs.LADDER.index("accumulation")])
    # on a CPU the rungs are timed together once all are set up (interleaved); a GPU measures each in turn (below)
    assert {r["status"] for r in report["rungs"]} == {"pending", "skipped"}


def test_each_rung_is_in_the_report_as_soon_as_it_is_measured():
    """What a GPU does: one rung after another, each measured before the next starts."""
    ladder = train_ladder.Ladder(PRESETS["gpt-smoke"], 2, 16, steps=1, warmup=1, device="cpu",
                                until="sdpa", interleave=False)
    reports = []
    ladder.climb(on_rung=lambda: reports.append(ladder.report()))
    assert [len(r["rungs"]) for r in reports] == list(range(1, len(ladder.plan) + 1))
    for report in reports:
        last = report["rungs"][-1]
        assert last["status"] == "skipped" or (last["status"] == "ok" and last["tokens_per_s"] > 0)


def test_training_benchmark_writes_why_when_no_rung_ran(chapter_script, tmp_path, monkeypatch):
    """Every rung out of memory (batch 32 on a T4): the JSON and the plot still say what happened to each."""
    fail_rungs(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB"), lambda s: True)
    chapter_script("ch05_training/gpu_benchmark.py").main(["--smoke", "--out", str(tmp_path)])
    report = written(tmp_path)
    applied = [r for r in report["rungs"] if r["status"] != "skipped"]
    assert applied and all(r["status"] == "error" and "CUDA out of memory" in r["note"] for r in applied)
    assert report["best_rung"] is None and report["transformers"]["status"] == "unavailable"
    assert "no rung ran" in report["transformers"]["note"] and list(tmp_path.glob("train_speed_*.png"))


def test_default_batch_is_the_largest_power_of_two_that_fits(chapter_script):
    script = chapter_script("ch05_training/gpu_benchmark.py")
    assert script.default_batch(lambda batch: batch <= 7) == 4  # e.g. a T4: 8 sequences of 1024 do not fit in fp32
    assert script.default_batch(lambda batch: batch <= 8) == 8
    assert script.default_batch(lambda batch: True) == script.MAX_DEFAULT_BATCH
    with pytest.raises(BatchSizeError):
        script.default_batch(lambda batch: False)


@pytest.mark.parametrize("script, flags", [
    ("ch05_training/gpu_benchmark.py", ["--batch", "0"]),
    ("ch05_training/gpu_benchmark.py", ["--steps", "-1"]),
    ("ch05_training/gpu_benchmark.py", ["--accumulation", "0"]),
    ("ch04_flops/gpu_benchmark.py", ["--max-batch", "0"]),
    ("ch04_flops/gpu_benchmark.py", ["--min-run-time", "0"]),
])
def test_benchmark_scripts_refuse_bad_sizes_before_any_work(chapter_script, capsys, script, flags):
    with pytest.raises(SystemExit) as exit_:
        chapter_script(script).main(flags)
    assert exit_.value.code == 2 and "invalid" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_rung_that_fails_with_any_error_is_recorded_and_the_ladder_goes_on(monkeypatch):
    """torch.compile without a C++ compiler raises CalledProcessError, not a RuntimeError."""
    error = subprocess.CalledProcessError(1, ["g++", "-shared"])
    fail_rungs(monkeypatch, error, lambda s: s.attn_implementation == "sdpa" and s.vocab_multiple == 1)
    report = train_bench.bench_train("gpt-smoke", 2, 16, steps=1, warmup=1, device="cpu", until="pad_vocab")
    rungs = {r["name"]: r for r in report["rungs"]}
    assert rungs["sdpa"]["status"] == "error" and rungs["sdpa"]["note"].startswith("CalledProcessError: Command")
    assert rungs["pad_vocab"]["status"] == "ok" and report["transformers"]["status"] == "ok"


def test_a_failing_race_with_transformers_is_recorded_and_the_ladder_stands(monkeypatch):
    def out_of_memory(model):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB")

    monkeypatch.setattr(train_peer, "transformers_peer", out_of_memory)
    report = train_bench.bench_train("gpt-smoke", 2, 16, steps=1, warmup=1, device="cpu", until="fused_adamw")
    assert report["transformers"]["status"] == "error" and report["ratio_vs_transformers"] is None
    assert report["transformers"]["note"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB"
    assert report["rungs"][0]["status"] == "ok" and report["best_rung"] is not None
    assert "CUDA out of memory" in train_report.format_report(report)


def test_a_failed_rungs_model_is_freed_before_the_next_rung(monkeypatch):
    """On a GPU the next rung needs that memory: an out-of-memory rung that kept its model would fail the rest."""
    built = []
    warm_up = train_ladder.warm_up

    def out_of_memory_once(step, n):
        built.append(weakref.ref(step.step.model))
        if len(built) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")
        return warm_up(step, n)

    monkeypatch.setattr(train_ladder, "warm_up", out_of_memory_once)
    ladder = train_ladder.Ladder(PRESETS["gpt-smoke"], 2, 16, steps=1, warmup=1, device="cpu", until="fused_adamw",
                                interleave=False)
    alive = []
    ladder.climb(on_rung=lambda: alive.append(built[0]() is not None))
    assert ladder.results[0].status == "error" and ladder.results[-1].status == "ok"
    assert not alive[0], "the failed baseline's model outlived its rung"
