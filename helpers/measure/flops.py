"""FLOPs of a GPT counted three ways and reconciled: by hand, by fvcore and by PyTorch's FlopCounterMode.

Conventions, as in the papers (Kaplan et al. 2020, PaLM's MFU): 2 FLOPs per multiply-add, and only matrix
multiplications count. Elementwise work (LayerNorm or RMSNorm, GELU or SiLU, RoPE's rotation, softmax, residual
adds) is O(d) per token against the matmuls' O(d²); it costs memory traffic, not FLOPs worth counting (the roofline
below shows where it sits).

* `forward_flops` / `training_step_flops`: by hand, split by matmul;
* `count_with_fvcore` / `count_with_flop_counter`: fvcore's `FlopCountAnalysis` (1 FLOP per multiply-add, skips
  `aten::scaled_dot_product_attention`) and PyTorch's `FlopCounterMode` (2 per multiply-add, has no formula for
  the CPU flash-attention kernel). Both report 2 per multiply-add here, by module, and add back what they missed;
* `fvcore_flops` / `flop_counter_flops`: the same for a whole preset without running it at full size;
* `flops_report`: the three side by side, by module.

What the hardware makes of these FLOPs is `helpers.measure.mfu` (peaks, MFU, throughput) and
`helpers.measure.roofline`. fvcore is imported when first used, so that importing this module (and every
`--help` of the command line) stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ..model.config import PRESETS, GPTConfig
from ..model.feed_forward import feed_forward_type
from ..model.gpt import GPT
from ..system.args import positive_int
from ..system.cli import Command, add_json

# ---- analytic counts ----


@dataclass(frozen=True)
class ForwardFlops:
    """FLOPs of one forward pass over `batch` sequences of `seq` tokens, by matmul (2 per multiply-add)."""

    batch: int
    seq: int
    qkv: int  # the Q, K, V projections (GPT-2's fused c_attn)
    attn_out: int  # attention output projection
    mlp: int  # the feed-forward's matmuls, as its registered type declares them
    attention_scores: int  # Q·Kᵀ over every (query, key) pair, as the counters and unmasked kernels count it
    attention_values: int  # softmax(Q·Kᵀ)·V, likewise
    attention_scores_causal: int  # only the pairs a causal mask keeps: T(T+1)/2 of T²
    attention_values_causal: int
    lm_head: int  # final projection to vocabulary logits

    @property
    def weights(self) -> int:
        """Matmuls against weight matrices inside the blocks: what "Linear layers" count, without the LM head."""
        return self.qkv + self.attn_out + self.mlp

    def attention(self, causal: bool = False) -> int:
        """The two activation-by-activation matmuls (no weights), which grow as seq²."""
        if causal:
            return self.attention_scores_causal + self.attention_values_causal
        return self.attention_scores + self.attention_values

    def total(self, causal: bool = False) -> int:
        return self.weights + self.attention(causal) + self.lm_head

    def per_token(self, causal: bool = False) -> float:
        return self.total(causal) / (self.batch * self.seq)

    def by_part(self) -> dict[str, int]:
        """Grouped as the model's modules are: attention (projections + QKᵀ + PV), feed-forward, LM head."""
        return {"attention": self.qkv + self.attn_out + self.attention(), "feed_forward": self.mlp,
                "lm_head": self.lm_head}

    def breakdown(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("batch", "seq")}


def check_shape(config: GPTConfig, batch: int, seq: int) -> None:
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq > config.context_length:
        raise ValueError(f"seq {seq} exceeds the model's context length {config.context_length}; "
                         f"use seq <= {config.context_length} or a config with a longer context_length")


def forward_flops(config: GPTConfig, batch: int, seq: int) -> ForwardFlops:
    """Forward FLOPs by hand: each (m x k)·(k x n) matmul is 2·m·k·n; embeddings are lookups (no FLOPs)."""
    check_shape(config, batch, seq)
    tokens, d, layers = batch * seq, config.d_model, config.n_layers
    mlp_per_token = sum(m.flops_per_token for m in feed_forward_type(config).matmuls(config))
    pairs, causal_pairs = seq * seq, seq * (seq + 1) // 2  # (query, key) pairs per sequence
    q_width = config.n_heads * config.head_dim  # d for GPT-2
    kv_width = config.kv_heads * config.head_dim  # narrower with grouped-query attention
    return ForwardFlops(
        batch=batch,
        seq=seq,
        qkv=layers * tokens * 2 * d * (q_width + 2 * kv_width),
        attn_out=layers * tokens * 2 * q_width * d,
        mlp=layers * tokens * mlp_per_token,
        # every query head: 2·T·T·head_dim, whichever key/value head it shares (GQA saves no attention FLOPs)
        attention_scores=layers * batch * 2 * pairs * q_width,
        attention_values=layers * batch * 2 * pairs * q_width,
        attention_scores_causal=layers * batch * 2 * causal_pairs * q_width,
        attention_values_causal=layers * batch * 2 * causal_pairs * q_width,
        lm_head=tokens * 2 * d * config.vocab_size,
    )


def training_step_flops(config: GPTConfig, batch: int, seq: int, recompute_attention: bool = False) -> int:
    """FLOPs of forward + backward: 3x the forward pass.

    Backward does two matmuls for every forward one, each as large: the gradient with respect to the matmul's
    input (to pass further back) and with respect to its weight (or, inside attention, its other operand). The
    optimizer step is O(parameters), negligible. MFU counts these *model* FLOPs only. Kernels that recompute
    (FlashAttention recomputes Q·Kᵀ in its backward) do more work; `recompute_attention=True` adds it, which is
    what a counter sees (hardware FLOPs, HFU).
    """
    fwd = forward_flops(config, batch, seq)
    return 3 * fwd.total() + (fwd.attention_scores if recompute_attention else 0)


# ---- the counters ----


@dataclass
class CounterFlops:
    """One counter's count of a forward (or training) pass, reported as 2 FLOPs per multiply-add."""

    counter: str  # "fvcore" or "flop_counter"
    total: int  # reconciled: what the counter counted plus what it missed, added back explicitly
    raw: int  # what the counter counted by itself (fvcore's count doubled to 2 per multiply-add)
    missed: dict[str, int]  # operator the counter has no formula for -> its FLOPs, added back (standard formula)
    by_module: dict[str, int]  # module name ("" = the whole model, "blocks.0.attn", "lm_head", ...) -> reconciled
    by_operator: dict[str, int]  # operator -> reconciled FLOPs
    unsupported: list[str]  # other operators seen without a formula (fvcore only; FlopCounterMode skips silently)

    def by_part(self) -> dict[str, int]:
        """Summed over the blocks like `ForwardFlops.by_part`: attention, feed-forward, LM head."""
        parts = {"attention": 0, "feed_forward": 0, "lm_head": self.by_module.get("lm_head", 0)}
        for name, flops in self.by_module.items():
            match = re.fullmatch(r"blocks\.\d+\.(attn|mlp)", name)
            if match:
                parts["attention" if match[1] == "attn" else "feed_forward"] += flops
        return parts


def import_fvcore():
    """fvcore's `FlopCountAnalysis` and its `get_shape`, imported on first use.

    fvcore scripts its focal loss when imported, which torch deprecates (a DeprecationWarning in 2.13, a
    FutureWarning, which Python shows to every user, from 2.14): whatever the category, it is fvcore's to fix,
    not the learner's.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.script` is deprecated")
        from fvcore.nn import FlopCountAnalysis
        from fvcore.nn.jit_handles import get_shape
    return FlopCountAnalysis, get_shape


def _fvcore_sdpa_macs(inputs, outputs) -> int:
    """fvcore handle for aten::scaled_dot_product_attention: Q·Kᵀ and P·V, every pair (as FlopCounterMode)."""
    get_shape = import_fvcore()[1]
    batch, heads, seq_q, head_dim = get_shape(inputs[0])
    seq_k, value_dim = get_shape(inputs[2])[-2:]
    return batch * heads * seq_q * seq_k * (head_dim + value_dim)


def _not_a_matmul(inputs, outputs) -> int:
    return 0


FVCORE_MISSED = {"aten::scaled_dot_product_attention": _fvcore_sdpa_macs}


# fvcore's LayerNorm/BatchNorm estimates (5 "FLOPs" per element) are not multiply-adds: counted 0, as elsewhere.
FVCORE_NON_MATMUL = ("aten::layer_norm", "aten::group_norm", "aten::batch_norm", "aten::instance_norm",
                     "aten::rms_norm")


def _fvcore_analysis(model: nn.Module, inputs: torch.Tensor):
    analysis = import_fvcore()[0](model, inputs)
    for name, handle in FVCORE_MISSED.items():
        analysis.set_op_handle(name, handle)
    for name in FVCORE_NON_MATMUL:
        analysis.set_op_handle(name, _not_a_matmul)
    return analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)


def _fvcore_result(by_operator: Counter, by_module: dict[str, int], unsupported: Counter) -> CounterFlops:
    by_operator = {f"aten::{op}": 2 * n for op, n in by_operator.items()}  # fvcore: 1 per multiply-add
    missed = {op: by_operator.get(op, 0) for op in FVCORE_MISSED}
    total = sum(by_operator.values())
    return CounterFlops("fvcore", total, total - sum(missed.values()), missed,
                        {name: 2 * n for name, n in by_module.items()}, by_operator, sorted(unsupported))


def count_with_fvcore(model: nn.Module, inputs: torch.Tensor) -> CounterFlops:
    """fvcore's FlopCountAnalysis (it traces the model with torch.jit, so it needs real tensors).

    fvcore counts 1 FLOP per multiply-add and has no handle for `aten::scaled_dot_product_attention`: it lists
    it among the unsupported operators and counts the attention matmuls as 0. We register a handle for it
    (the standard formula), double everything, and report the attention FLOPs as `missed`.
    """
    analysis = _fvcore_analysis(model, inputs)
    return _fvcore_result(analysis.by_operator(), dict(analysis.by_module()), analysis.unsupported_ops())


def fvcore_flops(config: GPTConfig, batch: int, seq: int) -> CounterFlops:
    """fvcore's count of a whole preset from a one-block model traced on one sequence (gpt2-xl does not fit a test).

    Every block is the same and every operator works per sequence, so the whole model's count is
    batch x (one-block model + (n_layers - 1) x that block). tests/test_flops.py checks this equals tracing
    the whole model at batch > 1.
    """
    check_shape(config, batch, seq)
    analysis = _fvcore_analysis(GPT(dataclasses.replace(config, n_layers=1, dropout=0.0)),
                                torch.zeros(1, seq, dtype=torch.long))
    extra = config.n_layers - 1  # blocks beyond the traced one
    block = analysis.by_module()["blocks.0"]
    block_ops = analysis.by_module_and_operator()["blocks.0"]
    by_operator = Counter({op: batch * (n + extra * block_ops.get(op, 0)) for op, n in analysis.by_operator().items()})
    by_module = {}
    for name, n in analysis.by_module().items():
        if name == "blocks.0" or name.startswith("blocks.0."):  # the same count for every block
            by_module.update({name.replace("blocks.0", f"blocks.{i}", 1): batch * n for i in range(config.n_layers)})
        elif name in ("", "blocks"):  # the totals that contain the blocks
            by_module[name] = batch * (n + extra * block)
        else:
            by_module[name] = batch * n
    return _fvcore_result(by_operator, by_module, analysis.unsupported_ops())


# torch.utils.flop_counter is imported where it is used: it imports triton (when installed), which would slow down
# every import of this module, the command line's --help included.


def _sdpa_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def _sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out, query, key, value)


def _grouped_mm(mat_a, mat_b, *args, out_shape=None, **kwargs) -> int:
    """Rows (S, in) against per-group weights (groups, in, out): each row meets one group's matrix."""
    return 2 * mat_a[0] * mat_a[1] * mat_b[-1]


def _flop_counter_missed() -> dict:
    """Kernels FlopCounterMode has no formula for: the CPU flash-attention kernel, MPS and backend-extension ones
    (their formulas are those PyTorch uses for the CUDA flash kernel, the backward one including recomputing Q·Kᵀ),
    and the grouped matrix product of a Mixture-of-Experts layer (`helpers.model.moe`)."""
    aten = torch.ops.aten
    names = {"_scaled_dot_product_flash_attention_for_cpu": _sdpa_forward,
             "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa_backward,
             "_scaled_dot_product_attention_math_for_mps": _sdpa_forward,
             "_scaled_dot_product_fused_attention_overrideable": _sdpa_forward,
             "_scaled_dot_product_fused_attention_overrideable_backward": _sdpa_backward,
             "_grouped_mm": _grouped_mm}
    return {getattr(aten, name): formula for name, formula in names.items() if hasattr(aten, name)}


def count_with_flop_counter(model: nn.Module, inputs: torch.Tensor, backward: bool = False) -> CounterFlops:
    """PyTorch's FlopCounterMode (2 FLOPs per multiply-add, counted at dispatch, so it works on fake tensors).

    It counts what it has a formula for and silently skips the rest: on CPU, SDPA runs
    `aten._scaled_dot_product_flash_attention_for_cpu`, which has none, so attention counts 0 there. We add
    formulas for the kernels it lacks and report their FLOPs as `missed`. `backward=True` counts forward + backward.
    """
    from torch.utils.flop_counter import FlopCounterMode

    added = _flop_counter_missed()
    with FlopCounterMode(display=False, custom_mapping=added) as counter:
        out = model(inputs)
        if backward:
            out.float().sum().backward()
    root = type(model).__name__
    counts = counter.get_flop_counts()
    by_module = {name.removeprefix(root).removeprefix("."): sum(ops.values())
                 for name, ops in counts.items() if name != "Global"}
    by_operator = {f"aten::{op.__name__}": n for op, n in counts.get("Global", {}).items()}
    missed = {f"aten::{op.__name__}": n for op, n in counts.get("Global", {}).items() if op in added}
    total = counter.get_total_flops()
    return CounterFlops("flop_counter", total, total - sum(missed.values()), missed, by_module, by_operator, [])


def flop_counter_flops(config: GPTConfig, batch: int, seq: int, backward: bool = False) -> CounterFlops:
    """FlopCounterMode on the whole preset built with fake CPU tensors: shapes only, no memory, no arithmetic.

    Fake CPU tensors dispatch to the same kernels as real ones (tests/test_flops.py checks the counts agree).
    """
    check_shape(config, batch, seq)
    with FakeTensorMode():
        model = GPT(dataclasses.replace(config, dropout=0.0))
        return count_with_flop_counter(model, torch.zeros(batch, seq, dtype=torch.long), backward)


def linear_layer_flops(config: GPTConfig, batch: int, seq: int) -> int:
    """What a module-hook counter such as thop sees: the nn.Linear layers only, 2 FLOPs per multiply-add.

    thop registers forward hooks on modules and returns multiply-adds; attention's Q·Kᵀ and P·V are tensor
    operations inside a module, not modules, so they are not counted.
    """
    check_shape(config, batch, seq)
    macs = 0

    def hook(module: nn.Linear, args, output: torch.Tensor) -> None:
        nonlocal macs
        macs += module.in_features * output.numel()

    with FakeTensorMode(), torch.no_grad():
        model = GPT(dataclasses.replace(config, dropout=0.0)).eval()
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(hook)
        model(torch.zeros(batch, seq, dtype=torch.long))
    return 2 * macs


def flops_report(config: GPTConfig, batch: int, seq: int) -> dict:
    """The three counts of one forward pass side by side, before and after reconciliation (for the CLI)."""
    fwd = forward_flops(config, batch, seq)
    fv, fc = fvcore_flops(config, batch, seq), flop_counter_flops(config, batch, seq)
    with torch.device("meta"):
        parameters = GPT(config).num_parameters()
    return {
        "units": "FLOPs of one forward pass, 2 per multiply-add (matmuls only)",
        "batch": batch, "ctx": seq, "parameters": parameters,
        "analytic": fwd.total(), "fvcore": fv.total, "flop_counter": fc.total,
        "fvcore_raw": fv.raw, "flop_counter_raw": fc.raw,
        "missed": {"fvcore": fv.missed, "flop_counter": fc.missed},
        "linear_layers_only": linear_layer_flops(config, batch, seq),
        "analytic_causal": fwd.total(causal=True),
        "per_token": fwd.per_token(),
        "training_step": training_step_flops(config, batch, seq),
        "breakdown": fwd.breakdown(),
        "by_part": {"analytic": fwd.by_part(), "fvcore": fv.by_part(), "flop_counter": fc.by_part()},
    }


def format_flops_report(report: dict) -> str:
    """`flops_report` as text: the counters before and after reconciliation, then the analytic breakdown."""
    analytic = report["analytic"]
    lines = [f"forward FLOPs (2 per multiply-add), batch {report['batch']} x ctx {report['ctx']}, "
             f"{report['parameters']:,} parameters",
             f"{'counter':<14} {'raw':>12} {'reconciled':>12} {'vs analytic':>12}  added back"]
    for name in ("analytic", "fvcore", "flop_counter"):
        raw = report.get(f"{name}_raw", analytic)
        added = ", ".join(f"{op} {n:.3e}" for op, n in report["missed"].get(name, {}).items()) or "-"
        lines.append(f"{name:<14} {raw:>12.4e} {report[name]:>12.4e} {report[name] / analytic:>12.4f}  {added}")
    lines.append(f"{'Linear only':<14} {report['linear_layers_only']:>12.4e}   (what a module-hook counter sees)")
    lines.append("analytic breakdown:")
    lines += [f"  {name:<24} {n:>12.4e}  {n / analytic:6.1%}" for name, n in report["breakdown"].items()
              if not name.endswith("_causal")]
    lines.append(f"  causal attention only    {report['analytic_causal']:>12.4e}  (total with the masked half skipped)")
    lines.append(f"per token {report['per_token']:.4e}; training step (3x forward) {report['training_step']:.4e}")
    return "\n".join(lines)


def _arguments(parser) -> None:
    parser.add_argument("--model", choices=list(PRESETS), default="gpt2-small", help="preset (default: gpt2-small)")
    parser.add_argument("--batch", type=positive_int, default=2, help="sequences per batch (default: 2)")
    parser.add_argument("--ctx", type=positive_int, help="tokens per sequence (default: the preset's context length)")
    add_json(parser)


def _run(args) -> int:
    config = PRESETS[args.model]
    ctx = config.context_length if args.ctx is None else args.ctx
    if ctx > config.context_length:
        args.command_parser.error(f"--ctx {ctx} is longer than {args.model}'s context length; pass --ctx "
                                  f"{config.context_length} or less")
    report = {"model": args.model, **flops_report(config, args.batch, ctx)}
    print(json.dumps(report, indent=2) if args.json else format_flops_report(report))
    return 0


COMMAND = Command("flops", "forward FLOPs of a preset by hand, by fvcore and by FlopCounterMode", _arguments, _run)
