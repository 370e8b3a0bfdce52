"""The memory plan (helpers.measure.memory_plan) against real execution, and every notebook's gpu scale planned on
the GPUs learners use: a free Colab T4 (14.7 GiB, fp16), an L4 (22 GiB, bf16) and an A100-40GB (bf16)."""

import dataclasses
import functools
import json
import re
import types
from pathlib import Path

import pytest
import torch

import helpers
from helpers.inference.kv_cache import kv_cache_bytes_per_token
from helpers.measure.attention_bench import make_step
from helpers.measure.memory_plan import (
    CUDA_CONTEXT_BYTES,
    GIB,
    LiveTensorBytes,
    MemoryPlan,
    MemoryPlanError,
    fitting,
    inference_plan,
    largest_fitting,
    plan_memory,
    training_step_plan,
)
from helpers.model.attention import CausalSelfAttention
from helpers.model.config import GPTConfig
from helpers.model.feed_forward import swiglu_hidden_dim
from helpers.notebooks import recorded_seconds
from helpers.system.device import REFERENCE_DEVICES, autocast_dtype

ROOT = Path(__file__).resolve().parents[1]
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
    lean = {"checkpointing": "block", "loss_chunk": 32}  # recomputed blocks and the chunked head, on both sides
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


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_the_chunked_head_is_planned_under_16_bit_autocast(low):
    """The autocast stand-in caches each weight's cast by the weight's id; a short-lived view of one (the head's
    transposed weight) freed and its id reused by another tensor once handed back a cast of the wrong shape."""
    config = GPTConfig.from_preset("gpt2-small")
    chunked = training_step_plan(config, 8, 1024, autocast=low, loss_chunk=128)
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
    kwargs = dict(dtype=dtype, autocast=autocast, cache_len=cache_len, int8_kv=int8_kv)
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


def small_width(p: dict, vocab: int = helpers.GPTConfig().vocab_size) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, context_length=p["CONTEXT"], d_model=p["D_MODEL"], n_heads=p["N_HEADS"],
                     n_layers=p["N_LAYERS"], dropout=0.0)


@functools.cache
def n_params(config: GPTConfig) -> int:
    with torch.device("meta"):
        return helpers.GPT(config).num_parameters()


def state_bytes(config: GPTConfig) -> int:
    """A trained model's weights and AdamW moments, without gradients (12 bytes per parameter)."""
    return 12 * n_params(config)


def workloads(notebook: str, p: dict, caps) -> list[tuple[str, int]]:
    """The largest training steps each notebook runs at its gpu scale, with what the notebook holds beside them."""
    low = autocast_dtype(caps)
    if notebook == "ch04_flops/02_flops_analysis.ipynb":
        return [(preset, training_step_plan(GPTConfig.from_preset(preset, dropout=0.0), p["BENCH_BATCH"],
                                            p["BENCH_SEQ"], autocast=low).peak_bytes) for preset in p["BENCH_PRESETS"]]
    if notebook == "ch05_training/01_pretraining.ipynb":  # the step by hand beside the Trainer's model (fp32)
        config = small_width(p, p["VOCAB"])
        return [("step by hand", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"]).peak_bytes
                 + 4 * n_params(config)),
                ("pretraining", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"], autocast=low).peak_bytes)]
    if notebook == "ch05_training/02_gradient_accumulation.ipynb":  # one fp32 batch of EFFECTIVE_BATCH sequences
        config = GPTConfig.from_preset(p["MEMORY_MODEL"], context_length=p["CONTEXT"])
        return [("one batch", training_step_plan(config, p["EFFECTIVE_BATCH"], p["CONTEXT"]).peak_bytes)]
    if notebook == "ch05_training/03_mixed_precision.ipynb":  # an fp32 step while three other trainers wait
        config = small_width(p, p["VOCAB"])
        return [("interleaved trainers", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"]).peak_bytes
                 + 3 * state_bytes(config))]
    if notebook == "ch05_training/04_training_speed.ipynb":  # the fp32 eager-attention rungs
        config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
        return [("fp32 eager", training_step_plan(config, p["BATCH"], p["CTX"], attn_implementation="eager",
                                                  fused_attention=False).peak_bytes)]
    if notebook == "ch05_training/05_lr_schedules.ipynb":
        return [("one run", training_step_plan(small_width(p, p["VOCAB"]), p["BATCH_SIZE"], p["CONTEXT"],
                                               autocast=low).peak_bytes)]
    if notebook == "ch05_training/08_activation_memory.ipynb":  # one model and AdamW for every setup, + its start
        config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
        return [("plain step", training_step_plan(config, p["BATCH"], p["CTX"], autocast=low).peak_bytes
                 + 4 * n_params(config))]
    if notebook == "ch05_training/solutions.ipynb":  # each section's largest step beside the models kept before it
        def sized(prefix):
            return GPTConfig(vocab_size=p[f"{prefix}_VOCAB"], context_length=p[f"{prefix}_CONTEXT"],
                             d_model=p[f"{prefix}_D_MODEL"], n_heads=p[f"{prefix}_N_HEADS"],
                             n_layers=p[f"{prefix}_N_LAYERS"], dropout=0.0)

        speed, act, lr = (GPTConfig.from_preset(p["SPEED_MODEL"], dropout=0.0),
                          GPTConfig.from_preset(p["ACT_MODEL"], dropout=0.0), sized("LR"))
        held = 4 * (n_params(sized("PRE")) + n_params(sized("AMP")))  # 5.1's model and 5.3's fp32 model
        def speed_step(batch):
            return training_step_plan(speed, batch, p["SPEED_CTX"])

        batch = largest_fitting(p["SPEED_BATCHES"], speed_step, caps, held_bytes=held)  # as 5.4 picks it
        held += 4 * n_params(speed)  # 5.4's model stays
        return [("5.4 fp32 step", speed_step(batch).peak_bytes + held - 4 * n_params(speed)),
                ("5.5 Trainer step beside the probe", training_step_plan(lr, p["LR_BATCH"], p["LR_CONTEXT"]).peak_bytes
                 + held + 8 * n_params(lr)),
                ("5.8 blocks pass", training_step_plan(act, p["ACT_BATCH"], p["ACT_CTX"], autocast=low,
                                                       loss_chunk=128).peak_bytes + held)]
    if notebook == "ch06_inference/02_quantization.ipynb":
        config = GPTConfig(**p["MODEL"], dropout=0.0)
        return [("training", training_step_plan(config, p["BATCH_SIZE"], config.context_length,
                                                autocast=low).peak_bytes)]
    return inference_and_later_workloads(notebook, p, caps)


def attention_step(name: str, batch: int, seq: int, d_model: int, heads: int, dtype: torch.dtype, mode: str) -> int:
    """chapter 3's benchmark step (helpers.measure.attention_bench.make_step), replayed on meta."""
    return plan_memory(lambda: make_step(name, batch, seq, d_model, heads, dtype, torch.device("meta"), mode)[1]()
                       ).peak_bytes


def activation_cases(tokens: int, d_model: int, dtype: torch.dtype) -> int:
    """ch04/01's activation benchmark: every case's input, output gradient and input gradient alive at once (four
    elementwise activations at 4d, SwiGLU's gate and up halves at 2h)."""
    hidden = swiglu_hidden_dim(d_model)

    def work():
        held = []
        for width, out in [(4 * d_model, 4 * d_model)] * 4 + [(2 * hidden, hidden)]:
            t_in = torch.zeros(tokens, width, dtype=dtype, requires_grad=True)
            grad = torch.ones(tokens, out, dtype=dtype)
            (t_in[:, :out] * 2).backward(grad)
            held.append((t_in, grad))
        return held

    return plan_memory(work).peak_bytes


def llama_style(p: dict, vocab: int, context: int, d_model: int, heads: int, layers: int, kv_heads: int,
                **more) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, context_length=context, d_model=d_model, n_heads=heads, n_layers=layers,
                     n_kv_heads=kv_heads, dropout=0.0, norm="rmsnorm", position_encoding="rope", ffn_type="swiglu",
                     bias=False, tie_weights=False, **more)


def inference_and_later_workloads(notebook: str, p: dict, caps) -> list[tuple[str, int]]:
    """The notebooks after the training chapters (and chapter 3's attention benchmarks): their largest step, each
    beside what the notebook holds then. Serving engines preallocate their whole paged cache, so a served run is
    planned as a generation with that many cached positions, plus one layer's keys and values gathered per step."""
    low = autocast_dtype(caps)
    low_or_fp32 = low or torch.float32
    if notebook == "ch03_attention/01_self_attention.ipynb":  # the float64 eager reference of the 4 modules
        return [("float64 eager reference", attention_step("eager", p["BATCH"], p["SEQ_LEN"], p["D_MODEL"],
                                                           p["N_HEADS"], torch.float64, "fwd"))]
    if notebook == "ch03_attention/02_efficient_mha.ipynb":  # the memory sweep grows eager's T x T scores
        dtype = getattr(torch, p["DTYPE"])
        return [("fwd + bwd, every implementation", attention_step("eager", p["BATCH"], p["SEQ_LEN"], p["D_MODEL"],
                                                                  p["N_HEADS"], dtype, "fwdbwd")),
                (f"eager at {max(p['MEMORY_SEQ_LENS'])} tokens", attention_step(
                    "eager", 1, max(p["MEMORY_SEQ_LENS"]), p["D_MODEL"], p["N_HEADS"], dtype, "fwd"))]
    if notebook == "ch03_attention/03_flash_attention.ipynb":
        return [(f"eager fwd + bwd at {max(p['SEQ_LENS'])} tokens", attention_step(
            "eager", 1, max(p["SEQ_LENS"]), p["D_MODEL"], p["N_HEADS"], getattr(torch, p["DTYPE"]), "fwdbwd"))]
    if notebook == "ch03_attention/solutions.ipynb":  # dropout's samples: one forward over many copies
        def dropout_samples():
            with torch.no_grad():
                return CausalSelfAttention(64, 4, dropout=0.1).train()(torch.zeros(p["DROPOUT_SAMPLES"], 16, 64))
        return [("dropout samples", plan_memory(dropout_samples).peak_bytes)]
    if notebook == "ch04_flops/01_gpt_model.ipynb":
        train = GPTConfig(vocab_size=5170, dropout=0.0, **{k: p["TRAIN"][k] for k in (
            "context_length", "d_model", "n_heads", "n_layers")})
        activations = activation_cases(p["TOKENS"], p["ACT_D_MODEL"], torch.float32)
        return [("activation benchmark, fp32", activations),
                ("training", training_step_plan(train, p["TRAIN"]["batch"], train.context_length,
                                                autocast=low).peak_bytes + activations // 2)]  # the fp16 cases stay
    if notebook == "ch04_flops/solutions.ipynb":
        preset, batch, seq = p["FORWARD"]
        return [("timed forward", inference_plan(GPTConfig.from_preset(preset, dropout=0.0), batch, seq,
                                                 autocast=low).peak_bytes)]
    if notebook == "ch05_training/06_memory_efficient_loading.ipynb":  # in a fresh process, one at a time
        big = n_params(GPTConfig.from_preset(p["BIG_MODEL"]))
        return [(f"{p['BIG_MODEL']}, two fp32 copies (map_location, on a host with RAM for two)", 8 * big)]
    if notebook == "ch05_training/07_decoding.ipynb":
        config = small_width(p, p["VOCAB"])
        gpt2 = GPTConfig.from_preset("gpt2-small", dropout=0.0)
        return [("training", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"], autocast=low).peak_bytes),
                ("GPT-2 decoding beside the trainer", inference_plan(gpt2, 1, 64, cache_len=128).peak_bytes
                 + state_bytes(config))]
    if notebook == "ch06_inference/01_kv_cache.ipynb":
        config, dtype = GPTConfig.from_preset(p["BATCH_PRESET"], dropout=0.0), getattr(torch, p["DTYPE"])
        return [("largest batch", inference_plan(config, max(p["BATCHES"]), p["BATCH_PROMPT_LEN"], dtype=dtype,
                                                 cache_len=p["BATCH_PROMPT_LEN"] + p["BATCH_NEW_TOKENS"]).peak_bytes
                 + n_params(GPTConfig.from_preset(p["BENCH_PRESET"])) * dtype.itemsize)]
    if notebook == "ch06_inference/03_continuous_batching.ipynb":  # bench_serve beside the model and its fp64 copy
        config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
        ctx = config.context_length
        gather = 2 * p["MAX_BATCH"] * ctx * config.d_model * 4
        return [("bench_serve, fp32", inference_plan(config, p["MAX_BATCH"], 1, cache_len=ctx).peak_bytes
                 + gather + 12 * n_params(config) + 192 * 16 * kv_cache_bytes_per_token(config))]
    if notebook == "ch06_inference/04_speculative_decoding.ipynb":
        target = GPTConfig(vocab_size=p["VOCAB"], context_length=p["CONTEXT"], dropout=0.0,
                           **dict(zip(("d_model", "n_heads", "n_layers"), p["TARGET_SHAPE"], strict=True)))
        cached = p["PROMPT_TOKENS"] + p["NEW_TOKENS"] + max(p["KS"])
        batches = inference_plan(target, 256, p["NEW_TOKENS"], cache_len=cached).peak_bytes + 64 * cached * \
            kv_cache_bytes_per_token(target)  # the batch-64 cache is still held
        return [("target training", training_step_plan(target, p["BATCH_SIZE"], p["CONTEXT"], autocast=low).peak_bytes),
                ("caches at batch 256 (+ AdamW moments kept)", batches + 8 * n_params(target))]
    if notebook == "ch06_inference/05_prefix_caching.ipynb":  # the fp64 check's engine keeps the bench's blocks
        config = GPTConfig.from_preset(p["MODEL"], context_length=p["CONTEXT"], dropout=0.0)
        held = 12 * n_params(config) + 2 * p["CONTEXT"] * kv_cache_bytes_per_token(config, torch.float64)
        return [("fp64 check", inference_plan(config, p["MAX_BATCH"], 1, dtype=torch.float64,
                                              cache_len=p["CONTEXT"]).peak_bytes + held)]
    if notebook == "ch06_inference/06_int8_kv_cache.ipynb":
        config = GPTConfig(vocab_size=p["VOCAB"], context_length=p["CONTEXT"], dropout=0.0,
                           **dict(zip(("d_model", "n_heads", "n_layers"), p["SHAPE"], strict=True)))
        return [("training", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"], autocast=low).peak_bytes)]
    if notebook == "ch06_inference/07_decode_bandwidth.ipynb":  # batch 64 at the context end, and its fp16 copy
        config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
        return [("decoding at the context end", inference_plan(config, max(p["BATCHES"]), 1, dtype=low_or_fp32,
                                                               cache_len=config.context_length).peak_bytes
                 + 4 * n_params(config))]
    if notebook == "ch06_inference/solutions.ipynb":  # the one GPU workload: 6.2's training
        config = GPTConfig(vocab_size=5170, dropout=0.0, **p["QUANT_MODEL"])
        return [("6.2 training", training_step_plan(config, p["BATCH_SIZE"], config.context_length,
                                                    autocast=low).peak_bytes)]
    if notebook == "ch07_parallel/solutions.ipynb":
        ddp, act = (GPTConfig.from_preset(spec[0], dropout=0.0, **spec[1]) for spec in (p["DDP_MODEL"], p["ACT_MODEL"]))
        zero = GPTConfig.from_preset(p["ZERO_MODEL"][0], dropout=0.0, **p["ZERO_MODEL"][1])
        vectors = 8 * n_params(ddp)  # one float64 copy of the model's size: a flat gradient, a model, a moment
        held = 12 * vectors  # 7.1's flat gradients and 7.2's float64 models and AdamW moments, still bound
        last_stage = dataclasses.replace(act, n_layers=-(-act.n_layers // p["ACT_STAGES"]))
        return [("7.1 float64 shard gradients", 2 * training_step_plan(ddp, p["DDP_BATCH"], ddp.context_length,
                                                                       steps=1).peak_bytes + 5 * vectors),
                # one stage's forward kept for its backward (the last: its blocks and the head), the model and its
                # stages beside it
                ("7.3 stage activations", plan_memory(lambda: helpers.GPT(last_stage)(
                    torch.zeros(p["ACT_BATCH"], act.context_length, dtype=torch.long))).peak_bytes + held
                 + 8 * n_params(act)),
                ("7.4 ZeRO's AdamW step", training_step_plan(zero, 2, zero.context_length, steps=1).peak_bytes
                 + held + 8 * n_params(act))]  # 7.3's model and its stages
    if notebook in ("ch08_modern_llm/01_from_gpt2_to_llama.ipynb", "ch08_modern_llm/solutions.ipynb"):
        config = llama_style(p, p["VOCAB"], p["CONTEXT"], p["D_MODEL"], p["N_HEADS"], p["N_LAYERS"], p["KV_HEADS"],
                             qk_norm=True)
        largest = llama_style(p, p["VOCAB"], p["CONTEXT"], p["D_MODEL"], p["N_HEADS"], p["N_LAYERS"], p["N_HEADS"])
        trainers_held = 6 if notebook.startswith("ch08_modern_llm/01") else 1  # 01 times its 7 trainers together
        return [("training beside the other trainers", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"],
                                                                          autocast=low).peak_bytes
                 + trainers_held * state_bytes(largest))]
    if notebook == "ch08_modern_llm/02_kv_memory.ipynb":
        mha, gqa = (llama_style(p, 4096, p["CONTEXT"], p["D_MODEL"], p["N_HEADS"], p["N_LAYERS"], kv)
                    for kv in (p["N_HEADS"], p["KV_HEADS"]))
        sequences = p["MHA_SEQUENCES"] * p["N_HEADS"] // p["KV_HEADS"]  # GQA's blocks at MHA's bytes
        gather = 2 * p["MAX_BATCH"] * p["CONTEXT"] * gqa.kv_heads * gqa.head_dim * 4
        return [("GQA served", inference_plan(gqa, sequences, 1, cache_len=p["CONTEXT"]).peak_bytes + gather
                 + 4 * n_params(mha))]
    raise KeyError(notebook)


NOTEBOOKS = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("ch*/*.ipynb"))
# Notebooks whose own process puts no tensor on the GPU at the gpu scale (each still holds a CUDA context from
# its setup cell's attention check), with the reason.
NO_GPU_WORK = {
    "ch02_text/01_tokenization.ipynb": "tokenizers run on the CPU",
    "ch02_text/02_data.ipynb": "datasets, loaders and one embedding lookup on the CPU",
    "ch02_text/solutions.ipynb": "tokenizers and tables on the CPU",
    **{f"ch07_parallel/0{i}_{name}.ipynb": "torchrun workers on the CPU with gloo: two processes, one GPU"
       for i, name in enumerate(["data_parallel", "tensor_parallel", "pipeline_parallel", "fsdp",
                                 "ddp_from_scratch"], start=1)},
}
PLANNED = [n for n in NOTEBOOKS if n not in NO_GPU_WORK]


@functools.cache
def planned_workloads(notebook: str, gpu: str) -> list[tuple[str, int]]:
    """`workloads` on that GPU, planned once for the tests and the README's table."""
    caps = REFERENCE_DEVICES[gpu]
    return workloads(notebook, parameters_of(notebook, caps), caps)


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
        if notebook in NO_GPU_WORK:
            lines.append(f"| `{notebook}` | none: {NO_GPU_WORK[notebook]} | – | – | – |")
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

# Rates assumed for a T4 (stated, not measured: no GPU ran these notebooks here). Matmuls sustain ~30% of its
# 65 TFLOP/s fp16 tensor-core peak and ~60% of its 8.1 TFLOP/s fp32 peak; memory ~70% of its 320 GB/s. At a small
# batch a pass is bound by launching its kernels instead: eager PyTorch launches ~15 per transformer block, ~20 us
# each with the Python around them: ~0.3 ms per block, ~0.2 ms for the embedding, the head and the sampling (a
# decode step of a 12-layer model: ~4 ms). A pass takes the longest of the three; a training step is three passes'
# launches (forward, backward, optimizer) and 6 FLOPs per parameter and token. Host work (tokenizers, float64
# checks, files) is a stated allowance per notebook.
T4_SUSTAINED = {torch.float16: 20e12, None: 5e12}
T4_BANDWIDTH = 220e9
LAUNCH_S_PER_BLOCK, LAUNCH_S_PER_CALL = 0.3e-3, 0.2e-3
T4_MINUTES = 8  # the budget of a notebook at its gpu scale on a free Colab T4
ACCEPTANCE = 0.6  # ch06/04: the distilled draft's tokens kept, per token (the cpu scale measured 49-80%)


def pass_seconds(config: GPTConfig, tokens: int, dtype=None, flops_per_param: int = 2, launches: int = 1) -> float:
    """One pass of a model over `tokens` tokens on a T4 (a forward by default; 6 FLOPs and 3 launches: a step)."""
    n = n_params(config)
    return max(flops_per_param * n * tokens / T4_SUSTAINED[dtype], n * (2 if dtype else 4) / T4_BANDWIDTH,
               launches * (config.n_layers * LAUNCH_S_PER_BLOCK + LAUNCH_S_PER_CALL))


def training_seconds(config: GPTConfig, steps: int, tokens_per_step: int, dtype) -> float:
    return steps * pass_seconds(config, tokens_per_step, dtype, flops_per_param=6, launches=3)


def speculative_decoding_seconds(p: dict, low) -> dict[str, float]:
    """ch06/04, cell by cell: a target and two drafts trained, then generations of NEW_TOKENS at batch 1."""
    def shape(d_model, heads, layers):
        return GPTConfig(vocab_size=p["VOCAB"], context_length=p["CONTEXT"], d_model=d_model, n_heads=heads,
                         n_layers=layers, dropout=0.0)

    target, draft = shape(*p["TARGET_SHAPE"]), shape(*p["DRAFT_SHAPE"])
    new, prompts, batch_tokens = p["NEW_TOKENS"], p["PROMPTS"], p["BATCH_SIZE"] * p["CONTEXT"]
    alone = new * pass_seconds(target, 1)

    def speculative(k, kept=ACCEPTANCE):  # a round: k draft steps, one target pass over k + 1 tokens
        per_round = sum(kept**j for j in range(k + 1))  # tokens a round writes, on average
        return new / per_round * (k * pass_seconds(draft, 1) + pass_seconds(target, k + 1))

    every_k = sum(speculative(k) for k in p["KS"])
    calls = p["ROUNDS"] + 2  # `interleaved`: a warm-up and a probe call before the rounds
    return {
        "training the target": training_seconds(target, p["TARGET_STEPS"], batch_tokens, low),
        "training a draft on the text": training_seconds(draft, p["DRAFT_STEPS"], batch_tokens, low),
        "distilling a draft": p["DISTILL_STEPS"] * (pass_seconds(target, batch_tokens, low)
                                                     + pass_seconds(draft, batch_tokens, None, 6, 3)),
        "acceptance of both drafts at every k": 2 * prompts * every_k,
        "same tokens as the target": prompts * (alone + speculative(4)),
        "timed generations": calls * prompts * (alone + new * pass_seconds(draft, 1) + every_k),
        "sampling: 20,000 draws, ~0.2 ms each, and k's generations": 20_000 * 0.2e-3 + prompts * speculative(
            p["KS"][-1]),
        "untrained draft, two prompts": 5 * 2 * (alone + speculative(p["KS"][-1], kept=0.0)),
        "a pass over 1 and 5 tokens by batch": sum(pass_seconds(target, b * p["CONTEXT"] // 2, None) + calls * (
            pass_seconds(target, b) + pass_seconds(target, 5 * b)) for b in (1, 8, 64, 256)),
        "host: tokenizer, data": 10,
    }


def chapter5_solutions_seconds(p: dict, low) -> dict[str, float]:
    """ch05 solutions, section by section (the workloads of chapter 5's notebooks, at these sizes)."""
    def shape(prefix, vocab=None):
        return GPTConfig(vocab_size=vocab or p[f"{prefix}_VOCAB"], context_length=p[f"{prefix}_CONTEXT"],
                         d_model=p[f"{prefix}_D_MODEL"], n_heads=p[f"{prefix}_N_HEADS"],
                         n_layers=p[f"{prefix}_N_LAYERS"], dropout=0.0)

    pre, acc, amp, lr = shape("PRE"), shape("ACC"), shape("AMP"), shape("LR")
    speed = GPTConfig.from_preset(p["SPEED_MODEL"], dropout=0.0)
    speed_tokens, act_tokens = max(p["SPEED_BATCHES"]) * p["SPEED_CTX"], p["ACT_BATCH"] * p["ACT_CTX"]
    pre_tokens, acc_tokens = p["PRE_BATCH"] * p["PRE_CONTEXT"], p["ACC_BATCH"] * p["ACC_CONTEXT"]
    lr_tokens = p["LR_BATCH"] * p["LR_CONTEXT"]
    decodes = p["DEC_NEW_TOKENS"] * (9 + 1 + 9 + 2 + len(p["DEC_TEMPERATURES"]))  # greedy, beams, penalties, KV
    return {
        "5.1: pretraining twice, evaluated": 2 * (training_seconds(pre, p["PRE_STEPS"], pre_tokens, low)
                                                 + 8 * pass_seconds(pre, pre_tokens, low)),
        "5.1: timed steps, two vocabularies": (p["PRE_ROUNDS"] + 2) * sum(
            pass_seconds(c, pre_tokens, low, 6, 3) for c in (pre, shape("PRE", helpers.GPTConfig().vocab_size))),
        "5.2: ragged batches, three runs": 3 * training_seconds(acc, p["ACC_STEPS"] * p["ACC_MICRO_BATCHES"],
                                                                acc_tokens // p["ACC_MICRO_BATCHES"], None),
        "5.2: noise scale": training_seconds(acc, p["ACC_TRAIN_STEPS"], acc_tokens, None) + 2 * p[
            "ACC_NOISE_BATCHES"] * 2 * training_seconds(acc, p["ACC_BATCH"], p["ACC_CONTEXT"], None),
        "5.3: loss scales and the fp32 run (no bf16 on a T4), ~120 syncs a step": training_seconds(
            amp, p["AMP_STEPS"], p["AMP_BATCH"] * p["AMP_CONTEXT"], None) + p["AMP_STEPS"] * 120 * 50e-6
        + 10 * pass_seconds(amp, p["AMP_BATCH"] * p["AMP_CONTEXT"], low, 6, 3),
        "5.4: optimizers, the model and its head timed in fp32 and 16 bits": (p["SPEED_ROUNDS"] + 2) * (
            pass_seconds(speed, speed_tokens, None, 6, 3) + pass_seconds(speed, speed_tokens, low, 6, 3)) + 33 * 0.03,
        "5.5: first updates and two schedules x seeds, evaluated": 5 * pass_seconds(lr, lr_tokens, None, 6, 3)
        + 2 * len(p["LR_SEEDS"]) * (training_seconds(lr, p["LR_STEPS"], lr_tokens, low)
                                    + 9 * pass_seconds(lr, 4 * lr_tokens, low)),
        "5.7: decoding, ~8 sequences at a time": decodes * pass_seconds(pre, 8 * 64),
        "5.8: the chunked head and checkpointing": 80 * pass_seconds(speed, act_tokens, low, 6, 3) / speed.n_layers
        + 27 * pass_seconds(speed, act_tokens, low, 8, 3),
        "host: tokenizers, float64 checks of 124M parameters, a 475 MB checkpoint loaded 4 times": 60,
    }


def chapter6_solutions_seconds(p: dict, low) -> dict[str, float]:
    """ch06 solutions: 6.2 trains and evaluates its model on the GPU; the serving engine, the speculative pair and
    6.7's benchmark are small models on the CPU at every scale."""
    quant = GPTConfig(vocab_size=helpers.GPTConfig().vocab_size, dropout=0.0, **p["QUANT_MODEL"])  # at most GPT-2's
    context = p["QUANT_MODEL"]["context_length"]
    recorded = recorded_seconds(ROOT / "ch06_inference/solutions.ipynb")  # at the cpu scale, on a 2-core CPU
    return {
        "6.2: training the model to quantize": training_seconds(quant, p["TRAIN_STEPS"], p["BATCH_SIZE"] * context,
                                                                low),
        "6.2: 26 evaluations and 6 calibrations, fp32": 32 * pass_seconds(quant, p["EVAL_WINDOWS"] * context),
        "host: the CPU's share, twice the whole notebook's recorded cpu-scale time (twice the requests)": 2 * recorded,
    }


T4_ESTIMATES = {
    "ch06_inference/solutions.ipynb": chapter6_solutions_seconds,
    "ch06_inference/04_speculative_decoding.ipynb": speculative_decoding_seconds,
    "ch05_training/solutions.ipynb": chapter5_solutions_seconds,
}


@pytest.mark.parametrize("notebook", list(T4_ESTIMATES))
def test_a_notebook_fits_its_time_on_a_t4_by_estimate(notebook, gpu_parameters):
    t4 = REFERENCE_DEVICES["t4"]
    seconds = T4_ESTIMATES[notebook](gpu_parameters(notebook, t4), autocast_dtype(t4))
    assert sum(seconds.values()) <= 60 * T4_MINUTES, {k: round(v) for k, v in seconds.items()}


def test_the_long_training_notebooks_fit_their_time_on_a_t4_by_estimate(gpu_parameters):
    t4 = REFERENCE_DEVICES["t4"]
    low = autocast_dtype(t4)
    pre, acc, mix, lr = (gpu_parameters(f"ch05_training/{name}.ipynb", t4) for name in (
        "01_pretraining", "02_gradient_accumulation", "03_mixed_precision", "05_lr_schedules"))
    modern = gpu_parameters("ch08_modern_llm/01_from_gpt2_to_llama.ipynb", t4)
    runs_lr = 2 + 2 + len(lr["SWEEP_LRS"]) * len(lr["SWEEP_WARMUPS"]) * len(lr["SEEDS"])  # sections 2-4
    estimates = {
        "pretraining": training_seconds(small_width(pre, pre["VOCAB"]), pre["STEPS"],
                                        pre["BATCH_SIZE"] * pre["CONTEXT"], low),
        "accumulation": training_seconds(small_width(acc), 2 * acc["TRAIN_STEPS"],
                                         acc["EFFECTIVE_BATCH"] * acc["CONTEXT"], None),
        "mixed precision": sum(training_seconds(small_width(mix, mix["VOCAB"]), mix["STEPS"],
                                                mix["BATCH_SIZE"] * mix["CONTEXT"], dtype)
                               for dtype in (None, None, low, low)),  # fp32, the fp32 yardstick, bf16 and fp16
        "lr schedules": training_seconds(small_width(lr, lr["VOCAB"]), runs_lr * lr["STEPS"],
                                         lr["BATCH_SIZE"] * lr["CONTEXT"], low),
        # the ladder of 7 variants, once per seed (GPT-2's width and depth; the variants differ by a few percent)
        "modern decoder": training_seconds(small_width(modern, modern["VOCAB"]), 7 * len(modern["SEEDS"])
                                           * modern["STEPS"], modern["BATCH_SIZE"] * modern["CONTEXT"], low),
    }
    # their training alone, within ten minutes: these notebooks are their training runs
    assert all(seconds <= 600 for seconds in estimates.values()), {k: round(v) for k, v in estimates.items()}
