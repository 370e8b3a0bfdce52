"""The roofline: a device's measured peak and memory bandwidths, and a GPT's operations placed on it by
arithmetic intensity (FLOPs per byte moved): below the ridge an operation is bound by memory, above by compute.

A small operation's data stays in cache between runs, so its memory roof is the bandwidth of the cache level
that holds its working set (`Calibration.level_for`), not main memory's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.config import GPTConfig
from ..model.feed_forward import feed_forward_type
from ..model.norm import norm_type
from ..system.device import dtype_name
from .calibration import Calibration
from .flops import check_shape
from .timing import Spread, interleaved

# Rough arithmetic per element of the elementwise operations (a feed-forward declares its activation's, a norm its own).
# Whatever the exact count, it is O(1) per element read, so their intensity stays near 1 FLOP/byte and memory bandwidth
# bounds them.
ELEMENTWISE_FLOPS = {"softmax": 5, "add": 1}


@dataclass(frozen=True)
class Operation:
    """One operation of a GPT forward pass: its FLOPs, the bytes it must move at least, and how to run it."""

    name: str
    kind: str  # "matmul", "attention" or "elementwise"
    flops: int
    bytes: int  # read every input once, write the output once
    make: Callable[[], Callable[[], object]]  # allocates the inputs, returns a zero-argument step
    device: torch.device

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte of memory traffic."""
        return self.flops / self.bytes


def roofline(intensity: float, peak_flops_per_s: float, bandwidth: float) -> float:
    """Attainable FLOP/s at an arithmetic intensity: memory-bound below the ridge point peak/bandwidth."""
    return min(peak_flops_per_s, intensity * bandwidth)


def gpt_operations(config: GPTConfig, batch: int, seq: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> list[Operation]:
    """The main operations of one block and the LM head at this size, with their FLOPs and minimum bytes moved."""
    check_shape(config, batch, seq)
    size, device = torch.empty((), dtype=dtype).element_size(), torch.device(device)
    tokens, d, heads, hd = batch * seq, config.d_model, config.n_heads, config.head_dim
    feed_forward, norm = feed_forward_type(config), norm_type(config)

    def randn(*shape):
        return lambda: torch.randn(*shape, device=device, dtype=dtype)

    def matmul(name: str, m: int, k: int, n: int) -> Operation:
        def make():
            x, w = randn(m, k)(), randn(n, k)()
            return lambda: F.linear(x, w)
        return Operation(name, "matmul", 2 * m * k * n, (m * k + k * n + m * n) * size, make, device)

    def expert_matmuls(name: str, experts: int, m: int, k: int, n: int) -> Operation:
        """m rows (a token's row for each of its experts) shared by `experts` weights as a balanced router shares
        them: each weight read once for its share. Timed as one batched product of equal shares (rounded up)."""
        used = min(experts, m)  # fewer rows than experts leave some weights unread

        def make():
            x, w = randn(used, -(-m // used), k)(), randn(used, n, k)()
            return lambda: torch.bmm(x, w.transpose(1, 2))
        return Operation(name, "matmul", 2 * m * k * n, (m * k + used * k * n + m * n) * size, make, device)

    def elementwise(name: str, flops_per_element: int, shape: tuple[int, int], fn, inputs: int = 1) -> Operation:
        def make():
            xs = [randn(*shape)() for _ in range(inputs)]
            return lambda: fn(*xs)
        numel = shape[0] * shape[1]
        return Operation(name, "elementwise", flops_per_element * numel, (inputs + 1) * numel * size, make, device)

    qkv = (batch, heads, seq, hd)
    scores = batch * heads * seq * seq

    def make_scores():
        q, k = randn(*qkv)(), randn(*qkv)()
        return lambda: q @ k.transpose(-2, -1)

    def make_sdpa():
        q, k, v = randn(*qkv)(), randn(*qkv)(), randn(*qkv)()
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def make_softmax():
        s = randn(batch, heads, seq, seq)()
        return lambda: torch.softmax(s, dim=-1)

    norm_module = norm(config).to(device=device, dtype=dtype).requires_grad_(False)
    return [
        matmul("QKV projection", tokens, d, 3 * d),
        matmul("attention output projection", tokens, d, d),
        *(matmul(m.label, tokens, m.in_features, m.out_features) if m.weights == 1
          else expert_matmuls(m.label, m.weights, tokens * m.per_token, m.in_features, m.out_features)
          for m in feed_forward.matmuls(config)),
        matmul("LM head", tokens, d, config.vocab_size),
        Operation("Q·Kᵀ scores (eager, writes T×T)", "attention", 2 * scores * hd,
                  (2 * batch * heads * seq * hd + scores) * size, make_scores, device),
        Operation("SDPA causal attention (fused)", "attention", 4 * batch * heads * hd * seq * (seq + 1) // 2,
                  4 * batch * heads * seq * hd * size, make_sdpa, device),
        Operation("softmax over scores (eager)", "elementwise", ELEMENTWISE_FLOPS["softmax"] * scores,
                  2 * scores * size, make_softmax, device),
        elementwise(norm.__name__, norm.flops_per_element, (tokens, d), norm_module),
        *(elementwise(op.label, op.flops_per_element, (tokens, op.width), op.run, op.inputs)
          for op in feed_forward.elementwise(config)),
        elementwise("residual add", ELEMENTWISE_FLOPS["add"], (tokens, d), torch.add, inputs=2),
    ]


def time_operation(op: Operation, rounds: int = 7) -> Spread:
    """Seconds of one run of `op` over `rounds` timed samples (after a warm-up run)."""
    return interleaved({op.name: op.make()}, op.device, rounds=rounds)[op.name]


@dataclass(frozen=True)
class Placement:
    """An operation on the roofline: its measured FLOP/s against the roof at its intensity and working set."""

    op: Operation
    achieved: Spread  # FLOP/s
    level: str  # the memory level whose bandwidth bounds it: L2, L3 or DRAM
    roof: float  # attainable FLOP/s, from the calibration's medians
    roof_high: float  # the same from the calibration's upper quartiles: the roof's own spread

    @property
    def of_roof(self) -> float:
        return self.achieved.median / self.roof

    @property
    def above_roof(self) -> bool:
        """Above the roof beyond both spreads: even its slower runs (first quartile) beat the roof's upper one."""
        return self.achieved.quartiles[0] > self.roof_high


def place(op: Operation, seconds: Spread, calibration: Calibration, dtype: torch.dtype | None) -> Placement:
    """Place a timed operation against the roof of its working set (`op.bytes`) on a calibrated device."""
    level = calibration.level_for(op.bytes)
    peak, bandwidth = calibration.peaks[dtype_name(dtype)], calibration.bandwidths[level]
    roof = roofline(op.intensity, peak.median, bandwidth.median)
    high = roofline(op.intensity, peak.quartiles[1], bandwidth.quartiles[1])
    return Placement(op, seconds.map(lambda s: op.flops / s), level, roof, high)
