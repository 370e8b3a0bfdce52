"""The timing layer: spread, the no-measurable-difference verdict, interleaved rounds; the calibration cache and
the roofs it gives the roofline."""

import json
import time

import pytest
import torch

from helpers.measure import calibration as cal
from helpers.measure.roofline import gpt_operations, place, time_operation
from helpers.measure.timing import Spread, interleaved, ratio, verdict
from helpers.model.config import GPTConfig
from helpers.system.files import CACHE_ENV

CPU = torch.device("cpu")


def test_spread_median_and_quartiles_match_statistics_by_hand():
    s = Spread((5.0, 1.0, 3.0, 2.0, 4.0))
    assert s.median == 3.0
    assert s.quartiles == (2.0, 4.0)  # inclusive quartiles of 1..5
    assert s.relative_iqr == pytest.approx(2 / 3)
    assert s.map(lambda x: 10 / x).median == pytest.approx(10 / 3)
    assert s.summary() == {"median": 3.0, "q1": 2.0, "q3": 4.0, "runs": 5}
    assert f"{s:.1f}" == "3.0 (IQR 2.0–4.0)"
    with pytest.raises(ValueError, match="at least one sample"):
        Spread(())


def test_overlapping_spreads_have_no_ratio():
    a, b = Spread((1.0, 1.1, 1.2, 1.3, 1.4)), Spread((1.2, 1.25, 1.3, 1.35, 1.4))
    assert a.overlaps(b) and b.overlaps(a)
    assert ratio(a, b) is None
    assert verdict("A", a, "B", b) == "A vs B: no measurable difference (their IQRs overlap)"


def test_separate_spreads_give_the_ratio_of_medians():
    fast, slow = Spread((9.0, 10.0, 11.0)), Spread((4.0, 5.0, 5.5))
    assert ratio(fast, slow) == 2.0
    assert verdict("fast", fast, "slow", slow) == "fast is 2.00x better than slow (IQRs apart)"
    # for seconds, lower is better: the same numbers read the other way
    assert verdict("fast", slow, "slow", fast, higher_is_better=False) == "fast is 2.00x better than slow (IQRs apart)"


def test_interleaved_runs_the_steps_in_turn_and_times_them():
    calls = []

    def step(name, seconds):
        def run():
            calls.append(name)
            time.sleep(seconds)
        return run

    spreads = interleaved({"a": step("a", 0.004), "b": step("b", 0.0)}, CPU, rounds=5, warmup=1, min_sample_s=0)
    assert calls[:2] == ["a", "a"] and calls[2:4] == ["b", "b"]  # warm-up and a probe each
    assert calls[4:] == ["a", "b"] * 5  # then A B A B ...
    assert len(spreads["a"].samples) == len(spreads["b"].samples) == 5
    assert spreads["a"].quartiles[0] >= 0.004 > spreads["b"].quartiles[1]
    with pytest.raises(ValueError, match="rounds must be 1 or more"):
        interleaved({"a": step("a", 0)}, CPU, rounds=0)


def test_interleaved_repeats_fast_steps_to_reach_the_timer_resolution():
    count = [0]

    def tick():
        count[0] += 1

    interleaved({"tick": tick}, CPU, rounds=3, warmup=0, min_sample_s=0.002)
    assert count[0] > 10  # each of the 3 samples ran the step many times


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def fake_calibration(**kwargs):
    return cal.Calibration("cpu", "Test CPU", torch.__version__, torch.get_num_threads(),
                           {"L2": 1 << 20, "L3": 32 << 20}, {"L2": 1 << 19, "L3": 16 << 20, "DRAM": 256 << 20},
                           peaks={"float32": Spread((1e11, 1.1e11, 1.2e11))},
                           bandwidths={"L2": Spread((90e9,)), "L3": Spread((150e9,)), "DRAM": Spread((30e9,))},
                           measured="2026-12-01", **kwargs)


def test_each_working_set_gets_the_fastest_level_that_holds_it():
    c = fake_calibration()
    assert c.level_for(100) == "L3"  # L2 holds it too, but the L3 probe measured faster
    assert c.level_for(20 << 20) == "L3"
    assert c.level_for(64 << 20) == "DRAM"
    assert c.bandwidth() == 30e9 and c.bandwidth(1 << 10) == 150e9
    assert c.peak(None) == c.peak(torch.float32) == 1.1e11


def test_placement_divides_by_the_roof_of_the_working_set():
    c = fake_calibration()
    add = {op.name: op for op in gpt_operations(GPTConfig.from_preset("gpt-smoke"), 2, 64)}["residual add"]
    seconds = Spread((add.bytes / 75e9,))  # moved its bytes at 75 GB/s
    p = place(add, seconds, c, None)
    assert p.level == "L3" and p.roof == pytest.approx(add.intensity * 150e9)
    assert p.of_roof == pytest.approx(0.5) and not p.above_roof
    # above the roof: only when even the op's slower runs beat the roof's upper quartile
    assert place(add, Spread((add.bytes / 160e9,) * 3), c, None).above_roof
    assert not place(add, Spread((add.bytes / 140e9, add.bytes / 160e9, add.bytes / 170e9)), c, None).above_roof


def test_calibration_is_measured_once_then_read_from_the_cache(cache, monkeypatch):
    real = cal.calibrate  # measured for real, at small sizes: this test is about the cache, not the figures
    monkeypatch.setattr(cal, "calibrate", lambda device, dtypes: real(device, dtypes, rounds=3, matmul_n=256,
                                                                      dram_bytes=16 << 20))
    first = cal.load_calibration("cpu")
    files = list(cache.glob("calibration-*.json"))
    assert len(files) == 1 and first.key in files[0].name
    assert set(first.bandwidths) >= {"DRAM"} and first.peak(None) > 0
    monkeypatch.setattr(cal, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr(cal, "measure_peak", lambda *a, **k: pytest.fail("measured again"))
    again = cal.load_calibration("cpu")
    assert again.to_json() == first.to_json()


def test_a_missing_dtype_is_measured_and_added(cache, monkeypatch):
    path = cache / f"calibration-{fake_calibration().key}.json"
    monkeypatch.setattr(cal, "detect_capabilities", lambda device=None: type(
        "Caps", (), {"device": CPU, "name": "Test CPU"})())
    path.write_text(json.dumps(fake_calibration().to_json()))
    measured = []
    monkeypatch.setattr(cal, "measure_peak", lambda device, dtype, n, rounds: measured.append(dtype) or Spread((5e11,)))
    c = cal.load_calibration("cpu", ("float32", "bfloat16"))
    assert measured == [torch.bfloat16]
    assert c.peak(torch.bfloat16) == 5e11 and c.peak(None) == 1.1e11
    assert set(json.loads(path.read_text())["peaks"]) == {"float32", "bfloat16"}


def test_the_peak_is_the_fastest_of_square_and_feed_forward_shapes(monkeypatch):
    """A device's fastest matmul shape varies; the peak is the best of them, so no layer's matmul beats its roof."""
    assert cal.peak_shapes(2048) == [(2048, 2048, 2048), (2048, 768, 3072), (2048, 3072, 768)]
    speeds = {(64, 64, 64, "a @ b"): 1.0, (64, 24, 96, "linear"): 0.5, (64, 96, 24, "linear"): 2.0}  # FLOP/s

    def fake(steps, device, rounds):
        assert len(steps) == 6  # three shapes, each as a @ b and as F.linear
        return {name: Spread((2 * name[0] * name[1] * name[2] / speeds.get(name, 0.1),) * rounds) for name in steps}

    monkeypatch.setattr(cal, "interleaved", fake)
    assert cal.measure_peak(CPU, torch.float32, 64, rounds=3).median == pytest.approx(2.0)


def test_the_key_changes_with_torch_threads_and_device():
    base = cal.calibration_key("cpu", "Test CPU", "2.13.0", 2)
    assert len({base, cal.calibration_key("cpu", "Test CPU", "2.14.1", 2), cal.calibration_key("cpu", "Test CPU",
                "2.13.0", 4), cal.calibration_key("cpu", "Other CPU", "2.13.0", 2)}) == 4


def test_a_damaged_cache_file_is_measured_again(cache, monkeypatch):
    monkeypatch.setattr(cal, "detect_capabilities", lambda device=None: type(
        "Caps", (), {"device": CPU, "name": "Test CPU"})())
    path = cache / f"calibration-{fake_calibration().key}.json"
    path.write_text("{not json")
    monkeypatch.setattr(cal, "calibrate", lambda device, dtypes: fake_calibration())
    assert cal.load_calibration("cpu").peak(None) == 1.1e11
    assert json.loads(path.read_text())["device_name"] == "Test CPU"


@pytest.mark.serial  # times operations against a calibration measured in the same run
def test_no_elementwise_operation_runs_far_above_its_roof(cache):
    """The old single main-memory roof put a cached residual add at 229% of its roof; against the roof of its
    working set's level, none may pass it by much (the margin covers the copy probe's write-allocate traffic
    and noise on a shared machine)."""
    c = cal.load_calibration("cpu")
    for op in gpt_operations(GPTConfig.from_preset("gpt-smoke"), 2, 64):
        if op.kind == "elementwise":
            p = place(op, time_operation(op, rounds=5), c, None)
            assert p.of_roof < 1.5, (op.name, p.level, p.of_roof)
