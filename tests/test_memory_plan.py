"""The memory plan (helpers.measure.memory_plan) against real execution, and every notebook's gpu scale planned on
the GPUs learners use: a free Colab T4 (14.7 GiB, fp16), an L4 (22 GiB, bf16) and an A100-40GB (bf16); the heavy
notebooks' time on a T4 by estimate (helpers.measure.time_plan). What each notebook runs there: helpers.manifest."""

import functools
import json
import re
import types
from pathlib import Path

import pytest
import torch

import helpers
from helpers.inference.kv_cache import kv_cache_bytes_per_token
from helpers.manifest import entry
from helpers.measure.memory_plan import (
    CUDA_CONTEXT_BYTES,
    GIB,
    LiveTensorBytes,
    MemoryPlan,
    MemoryPlanError,
    fitting,
    inference_plan,
    largest_fitting,
    training_step_plan,
)
from helpers.model.config import GPTConfig
from helpers.notebooks import ROOT, find_notebooks, recorded_seconds
from helpers.system.device import REFERENCE_DEVICES, autocast_dtype
from helpers.training.step import FULL, ChunkedLoss

GPUS = ["t4", "l4", "a100"]


def test_live_bytes_counts_storages_once_and_frees_them():
    with LiveTensorBytes() as live:
        a = torch.empty(1000)  # 4000 bytes
        view = a[:10]  # no new storage
        b = a * 2  # 4000 more
        assert live.current == 8000
        del a, view
        assert live.current == 4000  # a's storage went with its last reference
        c = b + 1
        del b, c
    assert live.peak == 8000 and live.current == 0


def test_saved_tensors_stay_alive_until_backward():
    with LiveTensorBytes() as live:
        w = torch.ones(256, requires_grad=True)
        y = (w.exp() * 3).sum()  # exp's output is saved for the backward
        held = live.current
        y.backward()
        del y
        assert live.current < held  # the saved activation is freed by the backward
    assert live.peak >= 3 * 256 * 4


SMALL = GPTConfig(vocab_size=256, context_length=256, d_model=64, n_heads=4, n_layers=2, dropout=0.0)


@pytest.mark.parametrize("config, autocast, implementation, fused", [
    (SMALL, None, "sdpa", True),  # CPU's fused SDPA kernel against the plan's stand-in
    (SMALL, None, "eager", False),  # T x T scores on both sides
    (SMALL, torch.bfloat16, "sdpa", True),  # autocast's casts and weight cache against the plan's
    # attention dropout: the CPU runs SDPA's math path (a GPU's fused kernels keep a seed, not a mask)
    (GPTConfig(vocab_size=4096, context_length=64, d_model=64, n_heads=4, n_layers=2, dropout=0.1), None, "sdpa",
     False),
])
def test_a_plan_on_meta_matches_the_same_steps_run_on_cpu(config, autocast, implementation, fused):
    seq = config.context_length
    planned = training_step_plan(config, 4, seq, autocast=autocast, attn_implementation=implementation,
                                 fused_attention=fused)
    measured = training_step_plan(config, 4, seq, autocast=autocast, attn_implementation=implementation, device="cpu")
    assert planned.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.02)
    if fused or autocast is not None:
        with pytest.raises(ValueError, match="in fp32 with fused_attention=False"):
            training_step_plan(config, 4, seq, autocast=autocast, fused_attention=fused, checkpointing="block")
        return
    lean = {"checkpointing": "block", "loss": ChunkedLoss(32)}  # recomputed blocks and the chunked head, both sides
    planned_lean = training_step_plan(config, 4, seq, autocast=autocast, attn_implementation=implementation,
                                      fused_attention=fused, **lean)
    measured_lean = training_step_plan(config, 4, seq, autocast=autocast, attn_implementation=implementation,
                                       device="cpu", **lean)
    assert planned_lean.peak_bytes == pytest.approx(measured_lean.peak_bytes, rel=0.02)
    assert measured_lean.peak_bytes < measured.peak_bytes
    # equal bytes, up to AdamW's scalar step counters (torch 2.8 on meta leaves them out: 4 bytes per tensor)
    counters = 8 * len(list(helpers.GPT(config).parameters()))
    assert planned.end_bytes == pytest.approx(measured.end_bytes, abs=counters)


def test_after_adamw_a_model_holds_weights_and_two_moments():
    plan = training_step_plan(SMALL, 2, 64)
    n_params = helpers.GPT(SMALL).num_parameters()
    n_tensors = len(list(helpers.GPT(SMALL).parameters()))
    assert 12 * n_params <= plan.end_bytes <= 12 * n_params + 8 * n_tensors  # + one step counter per tensor


class ScratchLoss:
    """The full loss, plus a scratch buffer of `nbytes` made before the forward and dropped once the optimizer has
    stepped (`after_step`): a loss that holds memory through its step."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.scratch = nbytes, None

    def __call__(self, model, x, y):
        self.scratch = torch.empty(self.nbytes, dtype=torch.uint8)
        return FULL(model, x, y)

    def after_step(self, model) -> None:
        self.scratch = None


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_plan_runs_the_steps_own_loss(device):
    """The plan runs the TrainingStep it plans, not a copy of it: a loss holding a buffer through its step raises the
    peak by that buffer, and its after_step hook frees it (a plan computing the loss its own way would see neither)."""
    extra = 3 << 20
    plain = training_step_plan(SMALL, 2, 64, device=device)
    held = training_step_plan(SMALL, 2, 64, device=device, loss=ScratchLoss(extra))
    assert held.peak_bytes == plain.peak_bytes + extra
    assert held.end_bytes == plain.end_bytes


def test_an_fp16_plan_takes_its_optimizer_steps():
    """fp16 trains through a GradScaler, which skips a step whose gradients overflowed; on meta its overflow flag
    has no value and reads as none, so AdamW's state is planned as a GPU allocates it."""
    n_params = helpers.GPT(SMALL).num_parameters()
    assert training_step_plan(SMALL, 2, 64, autocast=torch.float16).end_bytes >= 12 * n_params  # weights, 2 moments


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_the_chunked_head_is_planned_under_16_bit_autocast(low):
    """The autocast stand-in caches each weight's cast by the weight's id; a short-lived view of one (the head's
    transposed weight) freed and its id reused by another tensor once handed back a cast of the wrong shape."""
    config = GPTConfig.from_preset("gpt2-small")
    chunked = training_step_plan(config, 8, 1024, autocast=low, loss=ChunkedLoss(128))
    plain = training_step_plan(config, 8, 1024, autocast=low)
    assert chunked.end_bytes == plain.end_bytes  # the same weights and AdamW state
    logits = 8 * 1024 * config.vocab_size * 4  # fp32, as the loss computes them
    assert plain.peak_bytes - chunked.peak_bytes >= 2 * logits  # never the whole logits and their gradient


@pytest.mark.parametrize("dtype, autocast, cache_len, int8_kv", [
    (torch.float32, None, None, False),  # an evaluation: every position's logits and the loss
    (torch.float32, torch.bfloat16, None, False),  # fp32 weights, the forward under autocast
    (torch.float32, None, 200, False),  # a generation: the prefill into a cache of 200 positions, then one step
    (torch.bfloat16, None, 256, False),
    (torch.float32, None, 200, True),  # int8 keys and values with their scales
])
def test_an_inference_plan_on_meta_matches_the_same_pass_run_on_cpu(dtype, autocast, cache_len, int8_kv):
    kwargs = dict(dtype=dtype, autocast=autocast, cache_len=cache_len, kv_cache_dtype="int8" if int8_kv else "auto")
    planned, measured = inference_plan(SMALL, 4, 128, **kwargs), inference_plan(SMALL, 4, 128, device="cpu", **kwargs)
    assert planned.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.02)
    weights = helpers.GPT(SMALL).num_parameters() * dtype.itemsize  # the model arrives in its dtype
    cache = 0 if cache_len is None else 4 * cache_len * kv_cache_bytes_per_token(SMALL, torch.int8 if int8_kv
                                                                                  else dtype)
    scales = 4 * (cache_len or 0) * 2 * SMALL.n_layers * SMALL.kv_heads * 4 if int8_kv else 0  # fp32, per head
    assert planned.end_bytes == measured.end_bytes == weights + cache + scales
    assert planned.peak_bytes > planned.end_bytes


def test_a_generation_plan_grows_with_its_cache_and_an_evaluation_with_its_logits():
    config = GPTConfig.from_preset("gpt2-small")
    short, long = (inference_plan(config, 8, 128, dtype=torch.float16, cache_len=n) for n in (256, 1024))
    per_position = 8 * kv_cache_bytes_per_token(config, torch.float16)
    assert long.end_bytes - short.end_bytes == 768 * per_position
    with torch.device("meta"):
        n_params = helpers.GPT(config).num_parameters()
    assert short.peak_bytes - short.end_bytes < 2 * n_params  # built on the host: no fp32 copy on the GPU
    evaluation = inference_plan(config, 8, 1024, dtype=torch.float16)
    assert evaluation.peak_bytes - evaluation.end_bytes >= 8 * 1024 * config.vocab_size * 4  # fp32 logits at least


def test_fused_attention_is_linear_in_the_sequence_and_math_quadratic():
    config = GPTConfig(vocab_size=64, context_length=2048, d_model=64, n_heads=4, n_layers=1, dropout=0.0)
    fused = [training_step_plan(config, 1, t, steps=1).peak_bytes for t in (1024, 2048)]
    math = [training_step_plan(config, 1, t, steps=1, fused_attention=False).peak_bytes for t in (1024, 2048)]
    assert fused[1] / fused[0] < 2.2 and math[1] / math[0] > 3.5


def test_a_plan_fits_with_its_allowance():
    t4 = REFERENCE_DEVICES["t4"]
    assert MemoryPlan(12 * GIB, 0).fits(t4)  # 12 x 1.1 + 1 = 14.2 GiB of 14.7
    assert not MemoryPlan(13 * GIB, 0).fits(t4)  # 15.3 GiB
    assert MemoryPlan(13 * GIB, 0).required_bytes == int(13 * GIB * 1.1) + CUDA_CONTEXT_BYTES
    assert largest_fitting([4, 8, 16, 32], lambda b: MemoryPlan(b * GIB, 0), t4) == 8
    assert largest_fitting([4, 8, 16, 32], lambda b: MemoryPlan(b * GIB, 0), t4, held_bytes=5 * GIB) == 4  # 9.8 + 5
    with pytest.raises(MemoryPlanError, match=r"beside 12.0 GiB held"):
        largest_fitting([4], lambda b: MemoryPlan(b * GIB, 0), t4, held_bytes=12 * GIB)
    assert fitting(["small", "xl"], lambda p: MemoryPlan((4 if p == "small" else 50) * GIB, 0), t4) == ["small"]
    with pytest.raises(MemoryPlanError, match=r"none of \[32\] fits Tesla T4 \(14.7 GiB\): 32 needs 36.2 GiB"):
        largest_fitting([32], lambda b: MemoryPlan(b * GIB, 0), t4)
    cpu = REFERENCE_DEVICES["cpu"]  # 16 GiB of RAM, no CUDA context to allow for
    assert MemoryPlan(15 * GIB, 0).fits(cpu) and not MemoryPlan(17 * GIB, 0).fits(cpu)


# --- every notebook at its gpu scale ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_parameters():
    """The notebook's parameters cell, run as it runs on a machine with that GPU; read only, as the result is
    shared. Some cells plan GPT-2 sizes to choose theirs (seconds): once per notebook and GPU, by the tests using
    this fixture, which share one worker (tests/conftest.py)."""
    return parameters_of


def parameters_on(notebook: str, caps) -> dict:
    nb = json.loads((ROOT / notebook).read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    fake = types.SimpleNamespace(**{n: getattr(helpers, n) for n in helpers.__all__})
    fake.current_scale = lambda device_type=None: "gpu"
    fake.detect_capabilities = lambda device_type=None: caps
    namespace = {"helpers": fake}
    exec("".join(cell["source"]), namespace)
    return namespace


parameters_of = functools.cache(parameters_on)


NOTEBOOKS = [path.relative_to(ROOT).as_posix() for path in find_notebooks()]
PLANNED = [name for name in NOTEBOOKS if callable(entry(name).gpu_work)]  # the others put no tensor on the GPU


@functools.cache
def planned_workloads(notebook: str, gpu: str) -> list[tuple[str, int]]:
    """The notebook's largest steps on that GPU (its manifest entry's `gpu_work`), planned once for the tests and the
    README's table."""
    caps = REFERENCE_DEVICES[gpu]
    return entry(notebook).gpu_work(parameters_of(notebook, caps), caps)


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("notebook", PLANNED)
def test_every_notebook_plans_within_the_gpus_memory(notebook, gpu, gpu_parameters):
    caps = REFERENCE_DEVICES[gpu]
    planned = planned_workloads(notebook, gpu)
    assert planned, f"{notebook} runs nothing at the gpu scale on {caps.name}"
    for what, peak in planned:
        plan = MemoryPlan(peak, 0)
        assert plan.fits(caps), f"{notebook}, {what} on {caps.name}: {plan}, the GPU has " \
                                f"{caps.total_memory_bytes / GIB:.1f} GiB"


def memory_table() -> str:
    """The README's table: each notebook's largest planned step on each GPU, in GiB with the allowance."""
    lines = ["| notebook | largest step on a T4 | T4 (fp16) | L4 (bf16) | A100-40GB (bf16) |", "|---|---|---|---|---|"]
    for notebook in NOTEBOOKS:
        if notebook not in PLANNED:
            lines.append(f"| `{notebook}` | none: {entry(notebook).gpu_work} | – | – | – |")
            continue
        cells, what = [], None
        for gpu in GPUS:
            label, peak = max(planned_workloads(notebook, gpu), key=lambda w: w[1])
            what = what or label
            cells.append(f"{MemoryPlan(peak, 0).required_bytes / GIB:.1f}")
        lines.append(f"| `{notebook}` | {what} | {' | '.join(cells)} |")
    return "\n".join(lines)


def test_the_readme_shows_every_notebooks_plan(gpu_parameters):
    readme = (ROOT / "README.md").read_text()
    start, end = "<!-- memory plan: tests/test_memory_plan.py -->\n", "\n<!-- end of memory plan -->"
    shown = readme[readme.index(start) + len(start):readme.index(end)]
    expected = memory_table()
    message = "the README's memory table differs from the plans; it should read:\n" + expected

    def numbers(table):
        return [float(n) for n in re.findall(r"\| (\d+\.\d) ", table)]

    assert re.sub(r"\| \d+\.\d ", "| ", shown) == re.sub(r"\| \d+\.\d ", "| ", expected), message
    # within 5%: a replay allocates what that torch release's kernels and autograd allocate (the lowest torch the
    # course supports planned ch04/01's activation benchmark at 2.8 GiB, the CPU build it is recorded with at 2.7)
    assert numbers(shown) == pytest.approx(numbers(expected), rel=0.05), message


def test_a_t4_gets_fp16_where_a_notebook_used_to_hard_code_bf16(gpu_parameters):
    for notebook in ("ch03_attention/02_efficient_mha.ipynb", "ch03_attention/03_flash_attention.ipynb",
                     "ch06_inference/01_kv_cache.ipynb"):
        assert gpu_parameters(notebook, REFERENCE_DEVICES["t4"])["DTYPE"] == "float16", notebook
        assert gpu_parameters(notebook, REFERENCE_DEVICES["a100"])["DTYPE"] == "bfloat16", notebook


def test_the_gpu_sizes_follow_the_gpus_memory(gpu_parameters):
    """A T4 gets smaller batches than an A100, and only the GPT-2 sizes whose step fits."""
    accumulation, flops = "ch05_training/02_gradient_accumulation.ipynb", "ch04_flops/02_flops_analysis.ipynb"
    t4 = {n: gpu_parameters(n, REFERENCE_DEVICES["t4"]) for n in (accumulation, flops)}
    a100 = {n: gpu_parameters(n, REFERENCE_DEVICES["a100"]) for n in (accumulation, flops)}
    assert t4[accumulation]["EFFECTIVE_BATCH"] < a100[accumulation]["EFFECTIVE_BATCH"]
    assert t4[flops]["BENCH_PRESETS"] == ["gpt2-small"]
    assert len(a100[flops]["BENCH_PRESETS"]) > 1


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_at_the_gpu_scale_a_notebooks_device_is_the_gpu(notebook, gpu_parameters):
    """A device parameter hard-coded to the CPU sends the gpu scale's training to a free Colab's two vCPUs (hours)."""
    p = gpu_parameters(notebook, REFERENCE_DEVICES["t4"])
    devices = {name: value for name, value in p.items() if name.endswith("DEVICE")}
    assert all(str(value) == "cuda" for value in devices.values()), f"{notebook} on a T4: {devices}"


def code_cells(notebook: Path):
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] == "code":
            yield "".join(cell["source"])


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_a_model_that_trains_in_a_cell_is_on_the_notebooks_device(notebook):
    """A model built and trained by hand must be moved to DEVICE (a Trainer moves its own): at the gpu scale a
    124M-parameter step on the host is minutes of CPU time and more memory than a free Colab machine has. A float64
    model is a small exactness check, on the CPU on purpose (GPUs compute float64 slowly, if at all), as is a cell
    that says so ("on the CPU on purpose")."""
    cells = list(code_cells(ROOT / notebook))
    if not any(re.search(r"^DEVICE\s*=", source, re.MULTILINE) for source in cells):
        return  # a notebook without a device parameter runs on the CPU on purpose
    for source in cells:
        if ".backward(" in source and "on the CPU on purpose" not in source:
            for line in source.splitlines():
                if re.search(r"=\s*(helpers\.)?GPT\(", line) and ".double()" not in line:  # float64: a tiny exact
                    assert re.search(r"\.to\((DEVICE|device)", line), f"{notebook}: {line.strip()}"


# --- time at the gpu scale, by estimate -------------------------------------------------------------------------

@pytest.mark.parametrize("notebook", [name for name in NOTEBOOKS if entry(name).t4_time])
def test_a_notebook_fits_its_time_on_a_t4_by_estimate(notebook, gpu_parameters):
    t4 = REFERENCE_DEVICES["t4"]
    estimate = entry(notebook).t4_time(gpu_parameters(notebook, t4), autocast_dtype(t4), recorded_seconds(
        ROOT / notebook))
    assert estimate.fits, f"{notebook} on a T4: {estimate}"
