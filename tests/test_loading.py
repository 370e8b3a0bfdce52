"""Every loading strategy gives back the saved model (weights, logits, tied LM head); the memory ordering holds."""

import dataclasses
import importlib
import json
import statistics
from pathlib import Path

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.measure import load_bench
from helpers.measure.load_bench import reference_input, write_checkpoints
from helpers.model.loading import CHECKPOINT_FILES, STRATEGIES, StateMismatch, save_tensor_files, tie_weights

TINY = GPTConfig(vocab_size=97, context_length=32, d_model=48, n_heads=4, n_layers=2, dropout=0.0)
CONFIGS = {"tied": TINY, "untied": dataclasses.replace(TINY, tie_weights=False)}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Both configs written in every format by the benchmark's writer (seed 0)."""
    out = {}
    for label, config in CONFIGS.items():
        directory = tmp_path_factory.mktemp(label)
        write_checkpoints(str(directory), dataclasses.asdict(config))
        out[label] = directory
    return out


def saved_model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)  # as write_checkpoints
    return GPT(config).eval()


def load(name: str, directory: Path, config: GPTConfig) -> GPT:
    strategy = STRATEGIES[name]
    return strategy.load(directory / CHECKPOINT_FILES[strategy.checkpoint], config, CPU).eval()


@pytest.mark.parametrize("tie", list(CONFIGS))
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_gives_back_the_saved_model(checkpoints, name, tie):
    config = CONFIGS[tie]
    expected = saved_model(config)
    model = load(name, checkpoints[tie], config)
    got = model.state_dict()
    for key, tensor in expected.state_dict().items():
        assert torch.equal(got[key], tensor), key
    idx = reference_input(config)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), expected(idx), rtol=0, atol=0)
    assert (model.lm_head.weight is model.tok_emb.weight) == config.tie_weights
    assert model.num_parameters() == expected.num_parameters()


def test_assign_alone_unties_the_lm_head(checkpoints):
    with torch.device("meta"):
        model = GPT(TINY)
    path = checkpoints["tied"] / CHECKPOINT_FILES["pt"]
    model.load_state_dict(torch.load(path, mmap=True, weights_only=True), assign=True)
    assert model.lm_head.weight is not model.tok_emb.weight  # two Parameters: an optimizer would update both
    untied_count = model.num_parameters()
    tie_weights(model)
    assert model.lm_head.weight is model.tok_emb.weight
    assert untied_count - model.num_parameters() == TINY.vocab_size * TINY.d_model


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (from /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
@pytest.mark.parametrize(("name", "zero_copy"), [("mmap_assign", True), ("safetensors_file", True),
                                                 ("safetensors_lazy", True), ("baseline", False)])
def test_mapped_strategies_use_the_file_pages_themselves(checkpoints, name, zero_copy):
    model = load(name, checkpoints["tied"], TINY)
    ranges = mapped_ranges(checkpoints["tied"] / CHECKPOINT_FILES[STRATEGIES[name].checkpoint])
    in_file = [any(start <= p.data_ptr() < end for start, end in ranges) for p in model.parameters()]
    assert all(in_file) if zero_copy else not any(in_file)


def test_interrupted_tensor_files_save_keeps_the_previous_folder(tmp_path, monkeypatch):
    old = saved_model(TINY).state_dict()
    directory = save_tensor_files(old, tmp_path / "tensors")
    written = []
    real_save = torch.save

    def fail_on_third(obj, file, *args, **kwargs):
        written.append(file)
        if len(written) == 3:
            raise OSError("No space left on device")
        real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fail_on_third)
    with pytest.raises(OSError, match="No space left"):
        save_tensor_files({k: t + 1 for k, t in old.items()}, directory)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["tensors"]  # no partial folder left
    model = load("tensor_files", tmp_path, TINY)
    assert all(torch.equal(model.state_dict()[k], t) for k, t in old.items())


def test_incomplete_tensor_folder_is_named(checkpoints, tmp_path):
    folder = tmp_path / "tensors"
    folder.mkdir()
    for file in (checkpoints["tied"] / "tensors").glob("*.pt"):
        if file.name != "ln_f.bias.pt":
            (folder / file.name).write_bytes(file.read_bytes())
    with pytest.raises(StateMismatch, match="tensors does not fit this GPTConfig: 1 missing tensor.*ln_f.bias"):
        load("tensor_files", tmp_path, TINY)


@pytest.fixture(scope="module")
def other_depths(tmp_path_factory):
    """TINY's architecture with 1 and 3 layers, written in every format."""
    out = {}
    for layers in (1, 3):
        directory = tmp_path_factory.mktemp(f"layers{layers}")
        write_checkpoints(str(directory), dataclasses.asdict(dataclasses.replace(TINY, n_layers=layers)))
        out[layers] = directory
    return out


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_refuses_a_checkpoint_of_another_depth_and_names_the_tensors(other_depths, name):
    with pytest.raises(StateMismatch, match=r"unexpected tensor\(s\) \(blocks\.2\."):  # 3 layers into 2
        load(name, other_depths[3], TINY)
    with pytest.raises(StateMismatch, match=r"missing tensor\(s\) \(blocks\.1\."):  # 1 layer into 2
        load(name, other_depths[1], TINY)


@pytest.mark.parametrize("name", [n for n, s in STRATEGIES.items() if s.checkpoint != "tensor-files"])
def test_a_checkpoint_of_another_width_names_the_tensor_and_both_shapes(checkpoints, name):
    wider = dataclasses.replace(TINY, d_model=64)
    with pytest.raises(StateMismatch, match=r"tensor '[\w.]+' has shape \([^)]*48[^)]*\), the model expects "
                                            r"\([^)]*64[^)]*\)"):
        load(name, checkpoints["tied"], wider)


def in_this_process(function: str, timeout: float = 600, **kwargs):
    module, name = function.split(":")
    return getattr(importlib.import_module(module), name)(**kwargs)


def test_bench_skips_what_does_not_fit_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(load_bench, "run_in_fresh_process", in_this_process)  # the bookkeeping, not the numbers
    size = 4 * saved_model(TINY).num_parameters()
    monkeypatch.setattr(load_bench, "available_memory_bytes", lambda: int(1.5 * size))
    results = load_bench.bench_load(TINY, ["baseline", "mmap_assign"], directory=tmp_path, cold=True)
    by_name = {r.strategy: r for r in results}
    assert by_name["baseline"].status == "skipped" and "GiB of RAM" in by_name["baseline"].reason
    ok = by_name["mmap_assign"]
    assert ok.status == "ok" and ok.matches_reference and ok.cold and ok.model == "custom"


def test_load_seconds_is_the_spread_of_the_repeats():
    common = dict(strategy="mmap_assign", description="", model="custom", device="cpu", checkpoint_bytes=1,
                  peak_rss_bytes=1, peak_cuda_bytes=None, resident_file_bytes=0, matches_reference=True, cold=False)
    ran = load_bench.LoadBenchResult(status="ok", reason=None, seconds=0.2, first_forward_seconds=1.0,
                                     seconds_runs=[0.1, 0.2, 0.4], first_forward_seconds_runs=[1.0, 1.0, 2.0],
                                     **common)
    assert load_bench.load_seconds(ran).samples == (0.1, 0.2, 0.4)
    skipped = dataclasses.replace(ran, status="skipped", reason="needs ~2 GiB", seconds_runs=None)
    with pytest.raises(ValueError, match="mmap_assign did not run \\(needs ~2 GiB\\)"):
        load_bench.load_seconds(skipped)


def test_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown strategies \\['fast'\\]; valid: baseline, map_location"):
        load_bench.bench_load(TINY, ["fast"])
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        load_bench.bench_load(TINY, repeats=0)


@pytest.mark.serial  # peak RSS of fresh processes
def test_cli_json_and_mmap_peak_below_baseline(python_process):
    """Fresh processes, a 26 MB checkpoint: loading it the textbook way peaks at about two copies, mapped at one.

    Expected: baseline ~2.0x the checkpoint, the mapped strategies ~1.1x (the weights plus the 3 MB of logits of the
    forward pass that touches them). The math library's one-time buffers (~10 MB on the first LM-head-sized GEMM on
    some CPUs) are set up by the warm-up run, so they do not blur the ratio; an extra copy makes it ~0.7x."""
    done = python_process("-m", "helpers", "bench-load", "--model", "gpt-smoke", "--json", "--repeats", "2",
                          "--only", "baseline", "mmap_assign", "safetensors_file", check=True)
    rows = {r["strategy"]: r for r in json.loads(done.stdout)}
    assert list(rows) == ["baseline", "mmap_assign", "safetensors_file"]
    for row in rows.values():
        assert {"strategy", "peak_rss_bytes", "checkpoint_bytes", "seconds"} <= set(row)
        assert row["status"] == "ok" and row["matches_reference"] and row["model"] == "gpt-smoke"
        assert len(row["seconds_runs"]) == 2 and row["seconds"] == pytest.approx(statistics.median(row["seconds_runs"]))
    baseline = rows["baseline"]["peak_rss_bytes"]
    assert baseline > 1.5 * rows["mmap_assign"]["peak_rss_bytes"]
    assert baseline > 1.5 * rows["safetensors_file"]["peak_rss_bytes"]
    assert baseline > 1.5 * rows["baseline"]["checkpoint_bytes"]
