"""Int8 quantization of a GPT's Linear layers, from scratch, and the same with torchao.

Symmetric per-output-channel quantization stores each weight row i as int8 numbers q_ij and one float
scale s_i = max_j |w_ij| / 127, with w_ij ≈ s_i · q_ij; rounding to the nearest integer keeps the error of
every weight within s_i / 2. One scale per row (not per tensor) keeps a row of small weights from being
rounded away by another row's outlier. Two ways to compute with it:

* weight-only (W8A16): convert the int8 weights to floats in forward, run an ordinary matmul and scale each
  output channel (s_i factors out of output i's dot product). It saves memory (4x against fp32) and, with a
  fused kernel, memory traffic; in eager PyTorch the conversion is extra work on every call.
* dynamic activations (W8A8): quantize each input row at run time as well, multiply int8 by int8 into int32
  (`torch._int_mm`, which CPUs with VNNI or AMX run fast) and rescale by both scales.
"""

from __future__ import annotations

import io
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from ..system.optional import require

QMAX = 127  # symmetric int8 range [-127, 127]: zero maps to 0 exactly, and -128 is left unused
MODES = ("weight_only", "dynamic")
TORCHAO_METHODS = {"weight_only": "Int8WeightOnlyConfig", "dynamic": "Int8DynamicActivationInt8WeightConfig"}


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values (rows, cols) and one scale per row: round(w / s) with s = max |row| / 127."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"expected a floating-point matrix (out_features, in_features), got {w.dtype} "
                         f"of shape {tuple(w.shape)}")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))  # an all-zero row: any scale gives q = 0
    q = torch.round(w / scale[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(scale.dtype) * scale[:, None]


def quantize_per_row_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations (tokens, features) quantized per token at run time (their range is only known then)."""
    return quantize_per_channel(x)


class WeightOnlyInt8Matmul(torch.autograd.Function):
    """x · dequantize(q)ᵀ that keeps the int8 weights and their scales for the backward, not a float copy: the
    input's gradient dequantizes them again. Training through int8 weights (LoRA's adapters over a frozen int8
    base) then holds a quarter of the float weights' bytes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight_int8, scale)
        return F.linear(x, weight_int8.to(x.dtype)) * scale.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight_int8, scale = ctx.saved_tensors
        return (grad * scale.to(grad.dtype)) @ weight_int8.to(grad.dtype), None, None


class Int8Linear(nn.Module):
    """A Linear layer holding int8 weights and per-output-channel scales (plus the float bias).

    `mode="weight_only"` runs a float matmul on the int8 values, then scales; `mode="dynamic"` quantizes the
    input rows too and runs an int8 x int8 -> int32 matmul (CPU only here: CUDA's `torch._int_mm` has shape
    limits that torchao's kernels handle).
    """

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 mode: str = "weight_only") -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
        self.mode = mode
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str = "weight_only") -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight.detach())
        return cls(q, scale, linear.bias, mode)

    @property
    def weight(self) -> torch.Tensor:
        """The float weights these int8 values stand for (dequantized on each access)."""
        return dequantize_per_channel(self.weight_int8, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "weight_only":
            y = WeightOnlyInt8Matmul.apply(x, self.weight_int8, self.scale)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        if x.device.type != "cpu":
            raise RuntimeError("Int8Linear(mode='dynamic') runs on CPU; on a GPU use "
                               "helpers.inference.quantization.torchao_quantize(model, 'dynamic')")
        rows = x.reshape(-1, self.in_features)
        xq, xscale = quantize_per_row_dynamic(rows)
        acc = torch._int_mm(xq, self.weight_int8.t())  # exact int32 sums of int8 products
        y = acc.to(x.dtype) * (xscale[:, None] * self.scale.to(x.dtype)[None, :])
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """An embedding table stored as int8 rows with one scale per row, dequantized row by row on lookup.

    A tied GPT shares one matrix between the token embedding and the LM head; the head's output channels
    are the table's rows, so the head's per-channel int8 weights and scales serve both (`tie_int8_embedding`).
    """

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight_int8).to(self.scale.dtype) * self.scale[idx][..., None]


def quantize_linears(model: nn.Module, mode: str = "weight_only", skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every nn.Linear of `model` (in place) by an Int8Linear, except the submodules named in `skip`.

    Quantizing a GPT's `lm_head` unties it from the token embedding: the head gets its own int8 copy, the
    embedding keeps the float matrix (see `tie_int8_embedding`).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    names = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    unknown = set(skip) - names
    if unknown:
        raise ValueError(f"skip names no Linear layer of the model: {sorted(unknown)}; Linear layers include "
                         f"{sorted(names)[:5]}")
    for name in sorted(names - set(skip)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Int8Linear.from_linear(getattr(parent, child), mode))
    return model


def tie_int8_embedding(model: nn.Module) -> nn.Module:
    """Make a GPT's token embedding read the int8 weights and scales of its quantized LM head (in place),
    which restores the weight tying that `quantize_linears` broke: one int8 matrix instead of fp32 + int8."""
    if not model.config.tie_weights:
        raise ValueError("the model was built with tie_weights=False: its embedding and LM head differ")
    if not isinstance(model.lm_head, Int8Linear):
        raise ValueError("quantize the LM head first: quantize_linears(model) without skipping 'lm_head'")
    model.tok_emb = Int8Embedding(model.lm_head.weight_int8, model.lm_head.scale)
    return model


def saved_bytes(model: nn.Module) -> int:
    """Size of the model's state dict as `torch.save` writes it (a tensor shared by two names is stored once)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def import_torchao() -> ModuleType:
    """`import torchao`, or a one-line error saying how to install it (`import helpers` keeps its expected CPU-build
    log lines quiet: see `helpers.system.optional.ExpectedLibraryLogs`)."""
    return require("torchao", "int8 quantization with torchao")


def torchao_quantize(model: nn.Module, mode: str = "weight_only") -> nn.Module:
    """torchao's `quantize_` (in place) with its int8 weight-only or int8 dynamic-activation config.

    Like `quantize_linears`, it quantizes every nn.Linear, the tied LM head included, which unties it.
    """
    if mode not in TORCHAO_METHODS:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(TORCHAO_METHODS)}")
    torchao = import_torchao()
    # version 2: the Int8Tensor weights (torchao 0.15+; the default from 0.18), the same on every torchao release
    config = getattr(torchao.quantization, TORCHAO_METHODS[mode])(version=2)
    torchao.quantization.quantize_(model, config)
    return model
