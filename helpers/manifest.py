"""The course's notebooks, one entry each: where a notebook stands on the course's path, what it runs at the gpu
scale (for the memory plan and the T4 time estimate), the constants its prose may state and its exceptions.

What reads it: the core path (`make core`, the title cells' path lines, the README's times), the memory-plan and T4
tests and the README's memory table (tests/test_memory_plan.py), the prose test and the smoke runs. A new notebook
gets one `Notebook` entry below, in chapter order, and, if it puts tensors on the GPU, a function of its
parameters cell that names its largest steps; tests/test_manifest.py fails, naming what is missing, until it has.

Each memory function takes the notebook's parameters cell as run on a machine with that GPU (`p`) and the GPU
(`caps`), and returns (what, peak tensor bytes) for the largest steps it runs there, each with what the notebook
still holds beside it. Each time function takes `p`, the T4's autocast dtype (`low`) and the notebook's recorded
cpu-scale wall time, and adds up its work at `helpers.measure.time_plan`'s rates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .inference.kv_cache import kv_cache_bytes_per_token
from .measure.attention_bench import make_step
from .measure.memory_plan import (
    inference_plan,
    largest_fitting,
    parameter_count,
    plan_memory,
    training_step_plan,
)
from .measure.time_plan import NOTEBOOK_MINUTES, TRAINING_MINUTES, TimeEstimate, pass_seconds, training_seconds
from .model.attention import CausalSelfAttention
from .model.config import GPTConfig
from .model.feed_forward import swiglu_hidden_dim
from .model.gpt import GPT
from .system.device import DeviceCapabilities, autocast_dtype
from .training.step import ChunkedLoss

Workloads = Callable[[dict, DeviceCapabilities], list[tuple[str, int]]]
T4Time = Callable[[dict, torch.dtype | None, float | None], TimeEstimate]
ROLES = ("core", "deep dive", "solutions")


@dataclass(frozen=True, kw_only=True)
class Notebook:
    """One notebook of the course.

    role: "core" (on the core path, in this table's order), "deep dive" (into the core notebook it `extends`) or
    "solutions" (a chapter's worked answers). gpu_work: a function naming its largest steps at the gpu scale, or why it
    puts no tensor on the GPU there. t4_time: its time on a T4 by estimate, for the notebooks whose gpu-scale work
    is long. prose_constants: figures its markdown may state, each with why it holds on every machine
    (tests/test_prose.py). off_virtual_device: why its smoke run cannot put DEVICE on the virtual accelerator
    (`helpers.system.virtual_device`): it runs on the plain CPU, where a tensor it leaves on the CPU is not caught.
    reuses_run_of: the notebook whose finished training run it loads (its smoke run shares that one's cache).
    """

    path: str
    role: str
    gpu_work: Workloads | str
    extends: str | None = None
    t4_time: T4Time | None = None
    prose_constants: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    off_virtual_device: str | None = None
    reuses_run_of: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"{self.path}: role {self.role!r} is none of {ROLES}")
        if (self.role == "deep dive") != (self.extends is not None):
            raise ValueError(f"{self.path}: a deep dive, and only a deep dive, names the core notebook it extends")


# --- what a notebook runs at the gpu scale -----------------------------------------------------------------------

def small_width(p: dict, vocab: int = GPTConfig().vocab_size) -> GPTConfig:
    """The GPT that a notebook's CONTEXT, D_MODEL, N_HEADS and N_LAYERS parameters describe."""
    return GPTConfig(vocab_size=vocab, context_length=p["CONTEXT"], d_model=p["D_MODEL"], n_heads=p["N_HEADS"],
                     n_layers=p["N_LAYERS"], dropout=0.0)


def prefixed_width(p: dict, prefix: str, vocab: int | None = None) -> GPTConfig:
    """The GPT that a solutions notebook's section describes with parameters named `{prefix}_CONTEXT` and so on."""
    return GPTConfig(vocab_size=vocab or p[f"{prefix}_VOCAB"], context_length=p[f"{prefix}_CONTEXT"],
                     d_model=p[f"{prefix}_D_MODEL"], n_heads=p[f"{prefix}_N_HEADS"],
                     n_layers=p[f"{prefix}_N_LAYERS"], dropout=0.0)


def llama_style(vocab: int, context: int, d_model: int, heads: int, layers: int, kv_heads: int,
                **more) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, context_length=context, d_model=d_model, n_heads=heads, n_layers=layers,
                     n_kv_heads=kv_heads, dropout=0.0, norm="rmsnorm", position_encoding="rope", ffn_type="swiglu",
                     bias=False, tie_weights=False, **more)


def state_bytes(config: GPTConfig) -> int:
    """A trained model's weights and AdamW moments, without gradients (12 bytes per parameter)."""
    return 12 * parameter_count(config)


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


def self_attention_memory(p, caps):  # the float64 eager reference of the 4 modules
    return [("float64 eager reference", attention_step("eager", p["BATCH"], p["SEQ_LEN"], p["D_MODEL"],
                                                       p["N_HEADS"], torch.float64, "fwd"))]


def efficient_mha_memory(p, caps):  # the memory sweep grows eager's T x T scores
    dtype = getattr(torch, p["DTYPE"])
    return [("fwd + bwd, every implementation", attention_step("eager", p["BATCH"], p["SEQ_LEN"], p["D_MODEL"],
                                                              p["N_HEADS"], dtype, "fwdbwd")),
            (f"eager at {max(p['MEMORY_SEQ_LENS'])} tokens", attention_step(
                "eager", 1, max(p["MEMORY_SEQ_LENS"]), p["D_MODEL"], p["N_HEADS"], dtype, "fwd"))]


def flash_attention_memory(p, caps):
    return [(f"eager fwd + bwd at {max(p['SEQ_LENS'])} tokens", attention_step(
        "eager", 1, max(p["SEQ_LENS"]), p["D_MODEL"], p["N_HEADS"], getattr(torch, p["DTYPE"]), "fwdbwd"))]


def chapter3_solutions_memory(p, caps):  # dropout's samples: one forward over many copies
    def dropout_samples():
        with torch.no_grad():
            return CausalSelfAttention(64, 4, dropout=0.1).train()(torch.zeros(p["DROPOUT_SAMPLES"], 16, 64))
    return [("dropout samples", plan_memory(dropout_samples).peak_bytes)]


def activation_functions_memory(p, caps):
    train = GPTConfig(vocab_size=5170, dropout=0.0, **{k: p["TRAIN"][k] for k in (
        "context_length", "d_model", "n_heads", "n_layers")})
    activations = activation_cases(p["TOKENS"], p["ACT_D_MODEL"], torch.float32)
    return [("activation benchmark, fp32", activations),
            ("training", training_step_plan(train, p["TRAIN"]["batch"], train.context_length,
                                            autocast=autocast_dtype(caps)).peak_bytes
             + activations // 2)]  # the fp16 cases stay


def flops_analysis_memory(p, caps):
    return [(preset, training_step_plan(GPTConfig.from_preset(preset, dropout=0.0), p["BENCH_BATCH"],
                                        p["BENCH_SEQ"], autocast=autocast_dtype(caps)).peak_bytes)
            for preset in p["BENCH_PRESETS"]]


def chapter4_solutions_memory(p, caps):
    preset, batch, seq = p["FORWARD"]
    return [("timed forward", inference_plan(GPTConfig.from_preset(preset, dropout=0.0), batch, seq,
                                             autocast=autocast_dtype(caps)).peak_bytes)]


def resume_and_reuse_memory(p, caps):  # section 1's run; section 2's models are smaller
    return [("training step", training_step_plan(small_width(p, p["VOCAB"]), p["BATCH_SIZE"], p["CONTEXT"],
                                                 autocast=autocast_dtype(caps)).peak_bytes)]


def pretraining_memory(p, caps):  # the step by hand beside the Trainer's model (fp32)
    config = small_width(p, p["VOCAB"])
    return [("step by hand", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"]).peak_bytes
             + 4 * parameter_count(config)),
            ("pretraining", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"],
                                               autocast=autocast_dtype(caps)).peak_bytes)]


def gradient_accumulation_memory(p, caps):  # one fp32 batch of EFFECTIVE_BATCH sequences
    config = GPTConfig.from_preset(p["MEMORY_MODEL"], context_length=p["CONTEXT"])
    return [("one batch", training_step_plan(config, p["EFFECTIVE_BATCH"], p["CONTEXT"]).peak_bytes)]


def mixed_precision_memory(p, caps):  # an fp32 step while three other trainers wait
    config = small_width(p, p["VOCAB"])
    return [("interleaved trainers", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"]).peak_bytes
             + 3 * state_bytes(config))]


def training_speed_memory(p, caps):  # the fp32 eager-attention rungs
    config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
    return [("fp32 eager", training_step_plan(config, p["BATCH"], p["CTX"], attn_implementation="eager",
                                              fused_attention=False).peak_bytes)]


def lr_schedules_memory(p, caps):
    return [("one run", training_step_plan(small_width(p, p["VOCAB"]), p["BATCH_SIZE"], p["CONTEXT"],
                                           autocast=autocast_dtype(caps)).peak_bytes)]


def memory_efficient_loading_memory(p, caps):  # in a fresh process, one at a time
    big = parameter_count(GPTConfig.from_preset(p["BIG_MODEL"]))
    return [(f"{p['BIG_MODEL']}, two fp32 copies (map_location, on a host with RAM for two)", 8 * big)]


def decoding_memory(p, caps):
    config = small_width(p, p["VOCAB"])
    gpt2 = GPTConfig.from_preset("gpt2-small", dropout=0.0)
    return [("training", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"],
                                            autocast=autocast_dtype(caps)).peak_bytes),
            ("GPT-2 decoding beside the trainer", inference_plan(gpt2, 1, 64, cache_len=128).peak_bytes
             + state_bytes(config))]


def activation_memory_memory(p, caps):  # one model and AdamW for every setup, + its start
    config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
    return [("plain step", training_step_plan(config, p["BATCH"], p["CTX"], autocast=autocast_dtype(caps)).peak_bytes
             + 4 * parameter_count(config))]


def chapter5_solutions_memory(p, caps):  # each section's largest step beside the models kept before it
    low = autocast_dtype(caps)
    speed, act, lr = (GPTConfig.from_preset(p["SPEED_MODEL"], dropout=0.0),
                      GPTConfig.from_preset(p["ACT_MODEL"], dropout=0.0), prefixed_width(p, "LR"))
    held = 4 * (parameter_count(prefixed_width(p, "PRE")) + parameter_count(prefixed_width(p, "AMP")))  # 5.1, 5.3

    def speed_step(batch):
        return training_step_plan(speed, batch, p["SPEED_CTX"])

    batch = largest_fitting(p["SPEED_BATCHES"], speed_step, caps, held_bytes=held)  # as 5.4 picks it
    held += 4 * parameter_count(speed)  # 5.4's model stays
    return [("5.4 fp32 step", speed_step(batch).peak_bytes + held - 4 * parameter_count(speed)),
            ("5.5 Trainer step beside the probe", training_step_plan(lr, p["LR_BATCH"], p["LR_CONTEXT"]).peak_bytes
             + held + 8 * parameter_count(lr)),
            ("5.8 blocks pass", training_step_plan(act, p["ACT_BATCH"], p["ACT_CTX"], autocast=low,
                                                   loss=ChunkedLoss(128)).peak_bytes + held)]


# Serving engines preallocate their whole paged cache, so a served run is planned as a generation with that many
# cached positions, plus one layer's keys and values gathered per step.

def reused_pretraining(p, caps):
    """5.1's run, which a notebook that reuses it trains again where the course's cache does not hold it."""
    return ("5.1's training", training_step_plan(small_width(p, p["VOCAB"]), p["BATCH_SIZE"], p["CONTEXT"],
                                                 autocast=autocast_dtype(caps)).peak_bytes)


def kv_cache_memory(p, caps):  # 5.1's run, unless reused; the timed generation without a cache
    config, dtype = GPTConfig.from_preset(p["BENCH_PRESET"], dropout=0.0), getattr(torch, p["DTYPE"])
    return [reused_pretraining(p, caps),
            ("generation without a cache", inference_plan(config, 1, p["PROMPT_LEN"] + p["NEW_TOKENS"],
                                                          dtype=dtype).peak_bytes)]


def serving_over_http_memory(p, caps):  # the servers, their peer and the load generator run on the CPU
    return [reused_pretraining(p, caps)]


def quantization_memory(p, caps):
    config = GPTConfig(**p["MODEL"], dropout=0.0)
    return [("training", training_step_plan(config, p["BATCH_SIZE"], config.context_length,
                                            autocast=autocast_dtype(caps)).peak_bytes)]


def continuous_batching_memory(p, caps):  # bench_serve beside the model and its fp64 copy
    config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
    ctx = config.context_length
    gather = 2 * p["MAX_BATCH"] * ctx * config.d_model * 4
    return [("bench_serve, fp32", inference_plan(config, p["MAX_BATCH"], 1, cache_len=ctx).peak_bytes
             + gather + 12 * parameter_count(config) + 192 * 16 * kv_cache_bytes_per_token(config))]


def shaped_model(p: dict, d_model: int, heads: int, layers: int) -> GPTConfig:
    """The GPT of a notebook's VOCAB and CONTEXT and a (d_model, heads, layers) shape parameter."""
    return GPTConfig(vocab_size=p["VOCAB"], context_length=p["CONTEXT"], d_model=d_model, n_heads=heads,
                     n_layers=layers, dropout=0.0)


def speculative_decoding_memory(p, caps):
    target = shaped_model(p, *p["TARGET_SHAPE"])
    cached = p["PROMPT_TOKENS"] + p["NEW_TOKENS"] + max(p["KS"])
    batches = inference_plan(target, 256, p["NEW_TOKENS"], cache_len=cached).peak_bytes + 64 * cached * \
        kv_cache_bytes_per_token(target)  # the batch-64 cache is still held
    return [("target training", training_step_plan(target, p["BATCH_SIZE"], p["CONTEXT"],
                                                   autocast=autocast_dtype(caps)).peak_bytes),
            ("caches at batch 256 (+ AdamW moments kept)", batches + 8 * parameter_count(target))]


def prefix_caching_memory(p, caps):  # the fp64 check's engine keeps the bench's blocks
    config = GPTConfig.from_preset(p["MODEL"], context_length=p["CONTEXT"], dropout=0.0)
    held = 12 * parameter_count(config) + 2 * p["CONTEXT"] * kv_cache_bytes_per_token(config, torch.float64)
    return [("fp64 check", inference_plan(config, p["MAX_BATCH"], 1, dtype=torch.float64,
                                          cache_len=p["CONTEXT"]).peak_bytes + held)]


def int8_kv_cache_memory(p, caps):
    config = shaped_model(p, *p["SHAPE"])
    return [("training", training_step_plan(config, p["BATCH_SIZE"], p["CONTEXT"],
                                            autocast=autocast_dtype(caps)).peak_bytes)]


def decode_bandwidth_memory(p, caps):  # batch 64 at the context end, and its fp16 copy
    config = GPTConfig.from_preset(p["MODEL"], dropout=0.0)
    return [("decoding at the context end", inference_plan(config, max(p["BATCHES"]), 1,
                                                           dtype=autocast_dtype(caps) or torch.float32,
                                                           cache_len=config.context_length).peak_bytes
             + 4 * parameter_count(config))]


def chapter6_solutions_memory(p, caps):  # the one GPU workload: 6.2's training
    config = GPTConfig(vocab_size=5170, dropout=0.0, **p["QUANT_MODEL"])
    return [("6.2 training", training_step_plan(config, p["BATCH_SIZE"], config.context_length,
                                                autocast=autocast_dtype(caps)).peak_bytes)]


def chapter7_solutions_memory(p, caps):
    ddp, act = (GPTConfig.from_preset(spec[0], dropout=0.0, **spec[1]) for spec in (p["DDP_MODEL"], p["ACT_MODEL"]))
    zero = GPTConfig.from_preset(p["ZERO_MODEL"][0], dropout=0.0, **p["ZERO_MODEL"][1])
    vectors = 8 * parameter_count(ddp)  # one float64 copy of the model's size: a flat gradient, a model, a moment
    held = 12 * vectors  # 7.1's flat gradients and 7.2's float64 models and AdamW moments, still bound
    last_stage = dataclasses.replace(act, n_layers=-(-act.n_layers // p["ACT_STAGES"]))
    return [("7.1 float64 shard gradients", 2 * training_step_plan(ddp, p["DDP_BATCH"], ddp.context_length,
                                                                   steps=1).peak_bytes + 5 * vectors),
            # one stage's forward kept for its backward (the last: its blocks and the head), the model and its
            # stages beside it
            ("7.3 stage activations", plan_memory(lambda: GPT(last_stage)(
                torch.zeros(p["ACT_BATCH"], act.context_length, dtype=torch.long))).peak_bytes + held
             + 8 * parameter_count(act)),
            ("7.4 ZeRO's AdamW step", training_step_plan(zero, 2, zero.context_length, steps=1).peak_bytes
             + held + 8 * parameter_count(act))]  # 7.3's model and its stages


def modern_decoder_memory(trainers_held: int, reuses_pretraining: bool = False) -> Workloads:
    """ch08/01 and its solutions: a training step beside the trainers still held (01 times its 7 together); 01's
    last section reuses 5.1's run (its recipe in parameters named PRE_CONTEXT and so on), beside those trainers."""
    def workloads(p, caps):
        shape = (p["VOCAB"], p["CONTEXT"], p["D_MODEL"], p["N_HEADS"], p["N_LAYERS"])
        config, largest = llama_style(*shape, p["KV_HEADS"], qk_norm=True), llama_style(*shape, p["N_HEADS"])
        held = trainers_held * state_bytes(largest)
        rows = [("training beside the other trainers", training_step_plan(
            config, p["BATCH_SIZE"], p["CONTEXT"], autocast=autocast_dtype(caps)).peak_bytes + held)]
        if reuses_pretraining:
            pre = {name.removeprefix("PRE_"): value for name, value in p.items() if name.startswith("PRE_")}
            label, peak = reused_pretraining(pre | {"VOCAB": p["VOCAB"]}, caps)
            rows.append((f"{label}, beside the trainers", peak + held))
        return rows
    return workloads


def kv_memory_memory(p, caps):
    mha, gqa = (llama_style(4096, p["CONTEXT"], p["D_MODEL"], p["N_HEADS"], p["N_LAYERS"], kv)
                for kv in (p["N_HEADS"], p["KV_HEADS"]))
    sequences = p["MHA_SEQUENCES"] * p["N_HEADS"] // p["KV_HEADS"]  # GQA's blocks at MHA's bytes
    gather = 2 * p["MAX_BATCH"] * p["CONTEXT"] * gqa.kv_heads * gqa.head_dim * 4
    return [("GQA served", inference_plan(gqa, sequences, 1, cache_len=p["CONTEXT"]).peak_bytes + gather
             + 4 * parameter_count(mha))]


def mixture_of_experts_memory(p, caps):
    """ch08/03: its largest training step beside the eight trained models it keeps (weights only), and the dispatch
    timing's three trainers. The MoE's own step cannot be replayed on the meta device (its routing decides the
    shapes), so the plan takes the dense model of the MoE's total width for both: as many parameters, and more
    feed-forward activations (E experts' width for every token, against k experts' and the gathered copies)."""
    wide = llama_style(p["VOCAB"], p["CONTEXT"], p["D_MODEL"], p["N_HEADS"], p["N_LAYERS"], p["N_HEADS"],
                       ffn_hidden=p["N_EXPERTS"] * p["EXPERT_HIDDEN"])
    held = 8 * 4 * parameter_count(wide)  # the trained models, float32 weights
    step = training_step_plan(wide, p["BATCH_SIZE"], p["CONTEXT"], autocast=autocast_dtype(caps)).peak_bytes
    return [("the widest training step beside the trained models", step + held),
            ("dispatch timing: three trainers", step + 2 * state_bytes(wide) + held)]


def instruction_tuning_memory(models_held: int = 2) -> Workloads:
    """fp32 fine-tuning beside `models_held` fp32 models: the pretrained one and its copy with the markers, and in
    9.1 the fine-tuned model it serves."""
    def plan(p, caps):
        chat = small_width(p, p["VOCAB"] + 3)
        return [("pretraining", training_step_plan(small_width(p, p["VOCAB"]), p["BATCH_SIZE"], p["CONTEXT"],
                                                   autocast=autocast_dtype(caps)).peak_bytes),
                ("full fine-tuning, fp32", training_step_plan(chat, p["FT_BATCH"], p["CONTEXT"]).peak_bytes
                 + 4 * models_held * parameter_count(chat))]
    return plan


# --- time on a T4, by estimate -----------------------------------------------------------------------------------

ACCEPTANCE = 0.6  # ch06/04: the distilled draft's tokens kept, per token (the cpu scale measured 49-80%)


def training_run_time(parts: Callable[[dict, torch.dtype | None], float]) -> T4Time:
    """The time of a notebook that is its training runs: their training alone, within TRAINING_MINUTES."""
    return lambda p, low, recorded_s: TimeEstimate({"training": parts(p, low)}, TRAINING_MINUTES)


def pretraining_time(p, low):
    return training_seconds(small_width(p, p["VOCAB"]), p["STEPS"], p["BATCH_SIZE"] * p["CONTEXT"], low)


def gradient_accumulation_time(p, low):
    return training_seconds(small_width(p), 2 * p["TRAIN_STEPS"], p["EFFECTIVE_BATCH"] * p["CONTEXT"], None)


def mixed_precision_time(p, low):  # fp32, the fp32 yardstick, bf16 and fp16
    return sum(training_seconds(small_width(p, p["VOCAB"]), p["STEPS"], p["BATCH_SIZE"] * p["CONTEXT"], dtype)
               for dtype in (None, None, low, low))


def lr_schedules_time(p, low):
    runs = 2 + 2 + len(p["SWEEP_LRS"]) * len(p["SWEEP_WARMUPS"]) * len(p["SEEDS"])  # sections 2-4
    return training_seconds(small_width(p, p["VOCAB"]), runs * p["STEPS"], p["BATCH_SIZE"] * p["CONTEXT"], low)


def modern_decoder_time(p, low):  # the ladder of 7 variants, once per seed (they differ by a few percent)
    return training_seconds(small_width(p, p["VOCAB"]), 7 * len(p["SEEDS"]) * p["STEPS"],
                            p["BATCH_SIZE"] * p["CONTEXT"], low)


def speculative_decoding_time(p, low, recorded_s):
    """ch06/04, cell by cell: a target and two drafts trained, then generations of NEW_TOKENS at batch 1."""
    target, draft = shaped_model(p, *p["TARGET_SHAPE"]), shaped_model(p, *p["DRAFT_SHAPE"])
    new, prompts, batch_tokens = p["NEW_TOKENS"], p["PROMPTS"], p["BATCH_SIZE"] * p["CONTEXT"]
    alone = new * pass_seconds(target, 1)

    def speculative(k, kept=ACCEPTANCE):  # a round: k draft steps, one target pass over k + 1 tokens
        per_round = sum(kept**j for j in range(k + 1))  # tokens a round writes, on average
        return new / per_round * (k * pass_seconds(draft, 1) + pass_seconds(target, k + 1))

    every_k = sum(speculative(k) for k in p["KS"])
    calls = p["ROUNDS"] + 2  # `interleaved`: a warm-up and a probe call before the rounds
    return TimeEstimate({
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
    }, NOTEBOOK_MINUTES)


def chapter5_solutions_time(p, low, recorded_s):
    """ch05 solutions, section by section (the workloads of chapter 5's notebooks, at these sizes)."""
    pre, acc, amp, lr = (prefixed_width(p, prefix) for prefix in ("PRE", "ACC", "AMP", "LR"))
    speed = GPTConfig.from_preset(p["SPEED_MODEL"], dropout=0.0)
    speed_tokens, act_tokens = max(p["SPEED_BATCHES"]) * p["SPEED_CTX"], p["ACT_BATCH"] * p["ACT_CTX"]
    pre_tokens, acc_tokens = p["PRE_BATCH"] * p["PRE_CONTEXT"], p["ACC_BATCH"] * p["ACC_CONTEXT"]
    lr_tokens = p["LR_BATCH"] * p["LR_CONTEXT"]
    decodes = p["DEC_NEW_TOKENS"] * (9 + 1 + 9 + 2 + len(p["DEC_TEMPERATURES"]))  # greedy, beams, penalties, KV
    return TimeEstimate({
        "5.1: pretraining twice, evaluated": 2 * (training_seconds(pre, p["PRE_STEPS"], pre_tokens, low)
                                                 + 8 * pass_seconds(pre, pre_tokens, low)),
        "5.1: timed steps, two vocabularies": (p["PRE_ROUNDS"] + 2) * sum(
            pass_seconds(c, pre_tokens, low, 6, 3) for c in (pre, prefixed_width(p, "PRE", GPTConfig().vocab_size))),
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
    }, NOTEBOOK_MINUTES)


def chapter6_solutions_time(p, low, recorded_s):
    """ch06 solutions: 6.2 trains and evaluates its model on the GPU; the serving engine, the speculative pair and
    6.7's benchmark are small models on the CPU at every scale."""
    quant = GPTConfig(vocab_size=GPTConfig().vocab_size, dropout=0.0, **p["QUANT_MODEL"])  # at most GPT-2's
    context = p["QUANT_MODEL"]["context_length"]
    return TimeEstimate({
        "6.2: training the model to quantize": training_seconds(quant, p["TRAIN_STEPS"], p["BATCH_SIZE"] * context,
                                                                low),
        "6.2: 26 evaluations and 6 calibrations, fp32": 32 * pass_seconds(quant, p["EVAL_WINDOWS"] * context),
        # its cpu-scale run was recorded on a 2-core CPU
        "host: the CPU's share, twice the whole notebook's recorded cpu-scale time (twice the requests)":
            2 * recorded_s,
    }, NOTEBOOK_MINUTES)


WHERE_RUNS = 7  # 9.2's runs that ask where the adapters go: six sets of layers, and full with the embedding frozen


def fine_tuning_time(methods: Callable[[dict], int], baseline: bool, host: tuple[str, float],
                     sweep: Callable[[dict], float] = lambda p: 0) -> T4Time:
    """ch09's notebooks at the gpu scale: `methods(p)` ways of fine-tuning, each in fp32 once per seed, plus `sweep(p)`
    runs' worth of one-seed steps (LoRA's steps counted as full ones); then each model answers the held-out questions,
    and so does the few-shot baseline where there is one. The pretrained run is notebook 5.1's, reused from the
    cache. `host`: (what, seconds) the CPU does."""
    def estimate(p, low, recorded_s):
        chat = small_width(p, p["VOCAB"] + 3)
        runs = methods(p) * len(p["SEEDS"]) + sweep(p)
        return TimeEstimate({
            "fine-tuning, every method and seed": runs * training_seconds(chat, p["FT_STEPS"],
                                                                          p["FT_BATCH"] * p["CONTEXT"], None),
            "answers, 16 questions a batch, a pass per token": (runs + baseline) * -(-p["QUESTIONS"] // 16)
            * p["NEW_TOKENS"] * pass_seconds(chat, 16),
            f"host: {host[0]}": host[1],
        }, NOTEBOOK_MINUTES)
    return estimate


# --- the table -----------------------------------------------------------------------------------------------------

TORCHRUN_ON_CPU = "torchrun workers on the CPU with gloo: two processes, one GPU"
ATTENTION = "ch03_attention/01_self_attention.ipynb"
GPT_MODEL = "ch04_flops/01_gpt_model.ipynb"
PRETRAINING = "ch05_training/01_pretraining.ipynb"
KV_CACHE = "ch06_inference/01_kv_cache.ipynb"
MODERN_DECODER = "ch08_modern_llm/01_from_gpt2_to_llama.ipynb"
INSTRUCTION_TUNING = "ch09_finetuning/01_instruction_tuning.ipynb"
GPT2_INIT = MappingProxyType({"0.02": "GPT-2's initialisation"})
COMPILE_UNDER_A_MODE = "torch.compile ({}) does not trace under a mode"

NOTEBOOKS = (
    Notebook(path="ch02_text/01_tokenization.ipynb", role="core", gpu_work="tokenizers run on the CPU",
             prose_constants={share: "a share of the training text the exercise asks for (the solutions' SHARES)"
                              for share in ("10%", "30%")}),
    Notebook(path="ch02_text/02_data.ipynb", role="core",
             gpu_work="datasets, loaders and one embedding lookup on the CPU"),
    Notebook(path="ch02_text/solutions.ipynb", role="solutions", gpu_work="tokenizers and tables on the CPU"),
    Notebook(path=ATTENTION, role="core", gpu_work=self_attention_memory),
    Notebook(path="ch03_attention/02_efficient_mha.ipynb", role="deep dive", extends=ATTENTION,
             gpu_work=efficient_mha_memory, off_virtual_device=COMPILE_UNDER_A_MODE.format("FlexAttention's kernel"),
             prose_constants={"twice as slow": "what a ratio of 2 in the tables means"}),
    Notebook(path="ch03_attention/03_flash_attention.ipynb", role="deep dive", extends=ATTENTION,
             gpu_work=flash_attention_memory,
             prose_constants={"25%": "analytic: five backward matmuls against four",
                              "half the work": "analytic: causal tiling skips the tiles above the diagonal",
                              "1.8x": "the claim the notebook checks, quoted",
                              "1.3x": "the claim the notebook checks, quoted"}),
    Notebook(path="ch03_attention/solutions.ipynb", role="solutions", gpu_work=chapter3_solutions_memory,
             off_virtual_device="SDPA's CausalBias is a tensor subclass of its own",
             prose_constants={"half the memory": "one score matrix against two, counted on the meta device"}),
    Notebook(path=GPT_MODEL, role="core",
             gpu_work="the GPT it assembles runs its few forward passes and generations on the CPU",
             prose_constants={"4 x": "GPT-2's feed-forward width: four times d_model"}),
    Notebook(path="ch04_flops/02_flops_analysis.ipynb", role="deep dive", extends=GPT_MODEL,
             gpu_work=flops_analysis_memory, prose_constants={"312 TFLOP/s": "NVIDIA's datasheet figure for the A100"}),
    Notebook(path="ch04_flops/03_activation_functions.ipynb", role="deep dive", extends=GPT_MODEL,
             gpu_work=activation_functions_memory),
    Notebook(path="ch04_flops/solutions.ipynb", role="solutions", gpu_work=chapter4_solutions_memory),
    Notebook(path=PRETRAINING, role="core", gpu_work=pretraining_memory, t4_time=training_run_time(pretraining_time),
             prose_constants=GPT2_INIT),
    Notebook(path="ch05_training/02_gradient_accumulation.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=gradient_accumulation_memory, t4_time=training_run_time(gradient_accumulation_time)),
    Notebook(path="ch05_training/03_mixed_precision.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=mixed_precision_memory, t4_time=training_run_time(mixed_precision_time),
             prose_constants={"0.0078": "bf16's machine epsilon, 2**-7",
                              "5.96e-08": "fp16's smallest subnormal, 2**-24"}),
    Notebook(path="ch05_training/04_training_speed.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=training_speed_memory),
    Notebook(path="ch05_training/05_lr_schedules.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=lr_schedules_memory, t4_time=training_run_time(lr_schedules_time), prose_constants=GPT2_INIT),
    Notebook(path="ch05_training/06_memory_efficient_loading.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=memory_efficient_loading_memory,
             off_virtual_device="it loads in fresh processes, where the device does not exist"),
    Notebook(path="ch05_training/07_decoding.ipynb", role="core", gpu_work=decoding_memory, reuses_run_of=PRETRAINING,
             prose_constants={"124M parameters": "GPT-2 small's size"}),
    Notebook(path="ch05_training/08_activation_memory.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=activation_memory_memory),
    Notebook(path="ch05_training/09_resume_and_data_reuse.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=resume_and_reuse_memory),
    Notebook(path="ch05_training/solutions.ipynb", role="solutions", gpu_work=chapter5_solutions_memory,
             t4_time=chapter5_solutions_time),
    Notebook(path=KV_CACHE, role="core", gpu_work=kv_cache_memory, reuses_run_of=PRETRAINING),
    Notebook(path="ch06_inference/02_quantization.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=quantization_memory),
    Notebook(path="ch06_inference/03_continuous_batching.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=continuous_batching_memory),
    Notebook(path="ch06_inference/04_speculative_decoding.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=speculative_decoding_memory, t4_time=speculative_decoding_time),
    Notebook(path="ch06_inference/05_prefix_caching.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=prefix_caching_memory),
    Notebook(path="ch06_inference/06_int8_kv_cache.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=int8_kv_cache_memory),
    Notebook(path="ch06_inference/07_decode_bandwidth.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=decode_bandwidth_memory,
             off_virtual_device=COMPILE_UNDER_A_MODE.format("its compiled decode step")),
    Notebook(path="ch06_inference/08_serving_over_http.ipynb", role="deep dive", extends=KV_CACHE,
             gpu_work=serving_over_http_memory,
             reuses_run_of=PRETRAINING, prose_constants={"1.5x": "the issue's target against the peer, quoted"}),
    Notebook(path="ch06_inference/solutions.ipynb", role="solutions", gpu_work=chapter6_solutions_memory,
             t4_time=chapter6_solutions_time,
             prose_constants={"30 times smaller": "the outlier factor the exercise sets (with_outlier's factor=30)",
                              "30 times larger": "the outlier factor the exercise sets (with_outlier's factor=30)"}),
    Notebook(path="ch07_parallel/01_data_parallel.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=TORCHRUN_ON_CPU, prose_constants={"25 MiB": "DDP's default bucket_cap_mb"}),
    Notebook(path="ch07_parallel/02_tensor_parallel.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=TORCHRUN_ON_CPU),
    Notebook(path="ch07_parallel/03_pipeline_parallel.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=TORCHRUN_ON_CPU),
    Notebook(path="ch07_parallel/04_fsdp.ipynb", role="deep dive", extends=PRETRAINING, gpu_work=TORCHRUN_ON_CPU,
             prose_constants={"1.9 GB": "the ZeRO paper's table, which the sentence quotes"}),
    Notebook(path="ch07_parallel/05_ddp_from_scratch.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=TORCHRUN_ON_CPU),
    Notebook(path="ch07_parallel/solutions.ipynb", role="solutions", gpu_work=chapter7_solutions_memory,
             off_virtual_device="it counts saved activations' bytes through their storages in autograd hooks"),
    Notebook(path=MODERN_DECODER, role="core", gpu_work=modern_decoder_memory(trainers_held=6, reuses_pretraining=True),
             t4_time=training_run_time(modern_decoder_time), reuses_run_of=PRETRAINING,
             prose_constants={"1.2 GB": "Qwen3-0.6B's bf16 checkpoint"}),
    Notebook(path="ch08_modern_llm/02_kv_memory.ipynb", role="deep dive", extends=MODERN_DECODER,
             gpu_work=kv_memory_memory),
    Notebook(path="ch08_modern_llm/03_mixture_of_experts.ipynb", role="deep dive", extends=MODERN_DECODER,
             gpu_work=mixture_of_experts_memory),
    Notebook(path="ch08_modern_llm/solutions.ipynb", role="solutions", gpu_work=modern_decoder_memory(trainers_held=1)),
    Notebook(path=INSTRUCTION_TUNING, role="deep dive", extends=PRETRAINING, gpu_work=instruction_tuning_memory(3),
             t4_time=fine_tuning_time(lambda p: 1, baseline=True,
                                      host=("the instruction set, tokenizer, the server's start", 40)),
             reuses_run_of=PRETRAINING),
    Notebook(path="ch09_finetuning/02_lora.ipynb", role="deep dive", extends=PRETRAINING,
             gpu_work=instruction_tuning_memory(), reuses_run_of=PRETRAINING,
             t4_time=fine_tuning_time(lambda p: 2 + len(p["RANKS"]), baseline=False,
                                      sweep=lambda p: (len(p["FULL_LRS"]) + len(p["LORA_LRS"]) + WHERE_RUNS)
                                      * p["SWEEP_STEPS"] / p["FT_STEPS"],
                                      host=("the instruction set, tokenizer, plans of GPT-2's sizes", 60)),
             prose_constants={"10%": "the chapter's target for LoRA r16's answer loss against full fine-tuning",
                              "16 bytes per parameter": "analytic: fp32 weight, gradient and two AdamW moments"}),
    Notebook(path="ch09_finetuning/solutions.ipynb", role="solutions", gpu_work=instruction_tuning_memory(),
             reuses_run_of=PRETRAINING),
)
ENTRIES = {notebook.path: notebook for notebook in NOTEBOOKS}  # path -> entry
# The core path: the lessons a learner walks in this order, from text to a modern decoder (tokens, attention, the
# GPT, training it, decoding, the KV cache); every other lesson is a deep dive into the core notebook it extends.
CORE_PATH = tuple(notebook.path for notebook in NOTEBOOKS if notebook.role == "core")
DEEP_DIVES = {notebook.path: notebook.extends for notebook in NOTEBOOKS if notebook.role == "deep dive"}


REQUIRED = tuple(f.name for f in dataclasses.fields(Notebook)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def unlisted(paths: Iterable[str]) -> list[str]:
    """For each notebook (its path relative to the course's root) without an entry, a line that says what to add."""
    fields = ", ".join(f"{name}=..." for name in REQUIRED)
    return [f"{path} has no entry in helpers/manifest.py: add Notebook({fields}) in chapter order"
            for path in paths if path not in ENTRIES]


def entry(path: str) -> Notebook:
    """The manifest's entry of the notebook at `path` (relative to the course's root)."""
    if path not in ENTRIES:
        raise KeyError(unlisted([path])[0])
    return ENTRIES[path]
