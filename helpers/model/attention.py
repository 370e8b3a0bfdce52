"""Causal multi-head self-attention: one module, many implementations, the same weights.

`CausalSelfAttention` stores GPT-2's parameters (a fused `qkv` projection and `out_proj`); its
`attn_implementation` picks how the forward pass computes with them. `IMPLEMENTATIONS` lists every
name, so the same weights can run (and be compared, timed and measured) under each:

* layouts written out by hand: a wrapper over single-head attentions, stacked heads with separate
  Q/K/V projections, the fused QKV projection ("eager", as in GPT-2), einsum;
* PyTorch's kernels: SDPA with `is_causal=True`, SDPA with an explicit boolean mask,
  `torch.nn.MultiheadAttention`, FlexAttention;
* FlashAttention: flash-attn's `flash_attn_func`, and our from-scratch versions in PyTorch and Triton.

Each is an `AttentionBackend` that owns its limits: one that cannot run for a given device, dtype or
use says why (`IMPLEMENTATIONS[name].unavailable_reason(AttentionCall(...))`); it is never silently
replaced by another. It also owns attention over a KV cache (`AttentionBackend.attend`), whatever holds the keys
and values: each cache says what it holds and how to read it (`CachedKV`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..system.device import dtype_name
from ..system.optional import require, version_of
from .rope import apply_rope

# ---- kernels: q (batch, heads, seq_q, head_dim), k and v (batch, heads, seq_k, head_dim) -> like q ----
#
# Every kernel computes causal attention over a square score matrix (training, a whole prompt). The masked ones
# (eager, sdpa, sdpa_mask) also take `attn_mask` (True = may attend, broadcast to (batch, heads, seq_q, seq_k))
# with `is_causal=False`: what attention over a KV cache needs (new queries against every cached key).


def kv_groups(q: torch.Tensor, k: torch.Tensor) -> int:
    """Query heads per key/value head: 1 for multi-head attention, more for grouped-query attention (GQA).

    Under torch.jit.trace (fvcore counts FLOPs that way) sizes are traced tensors; head counts are constants of the
    model, so reading them as numbers is exact, and the tracer's warning that it might not be is silenced. Only
    there: torch.compile cannot trace a change of warning filters and would split the graph at every layer.
    """
    if not torch.jit.is_tracing():
        return q.size(1) // k.size(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return int(q.size(1)) // int(k.size(1))


def repeat_kv(k: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query attention by copying: each of k's heads repeated for the `groups` query heads it serves.

    Query head h reads key/value head h // groups (the layout of LLaMA's `repeat_kv`). The copy costs memory
    traffic; kernels that index the shared head instead (SDPA's enable_gqa, flash-attn) skip it.
    """
    return k if groups == 1 else k.repeat_interleave(groups, dim=1)


def _future_mask(seq: int, device: torch.device) -> torch.Tensor:
    """True above the diagonal: the positions a causal query must not see."""
    return torch.ones(seq, seq, dtype=torch.bool, device=device).triu(diagonal=1)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    attn_mask: torch.Tensor | None = None, is_causal: bool = True) -> torch.Tensor:
    """Textbook attention: materialises the (seq x seq) score matrix, so memory grows as T^2."""
    groups = kv_groups(q, k)
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    if is_causal:
        scores = scores.masked_fill(_future_mask(q.size(-2), q.device), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def fused_kernel_shares_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                                 dropout_p: float, is_causal: bool) -> bool:
    """Whether one of SDPA's fused kernels takes these inputs with grouped key/value heads (`enable_gqa`).

    On the CPU they stay shared (recent PyTorch runs them in its CPU flash kernel, with or without a mask; torch
    2.8 in the math one). On CUDA PyTorch is asked: flash takes grouped heads but needs sm80+, 16-bit inputs and
    no mask; the memory-efficient kernel takes them only in recent releases. Where none does, SDPA falls back to
    its math kernel, which materialises the T x T scores.
    """
    if q.device.type != "cuda" or torch.compiler.is_compiling():  # compiled: the compiler picks the kernel
        return True
    params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, dropout_p, is_causal, True)
    return torch.backends.cuda.can_use_flash_attention(params) or torch.backends.cuda.can_use_efficient_attention(
        params)


def sdpa_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                 attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """SDPA over grouped-query heads: shared in the kernel where a fused kernel takes them, else copied
    (`repeat_kv`), so that the memory-efficient kernel runs instead of the math one (a T4, a masked call)."""
    groups = kv_groups(q, k)
    if groups > 1 and not fused_kernel_shares_kv_heads(q, k, v, attn_mask, dropout_p, is_causal):
        k, v, groups = repeat_kv(k, groups), repeat_kv(v, groups), 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          enable_gqa=groups > 1)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                   attn_mask: torch.Tensor | None = None, is_causal: bool = True) -> torch.Tensor:
    """PyTorch's fused kernel; `is_causal=True` (no explicit mask) lets it pick FlashAttention. Fewer key/value heads
    than query heads (GQA) are shared in the kernel where one takes them (`sdpa_grouped`)."""
    return sdpa_grouped(q, k, v, dropout_p, attn_mask, is_causal)


def sdpa_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                          attn_mask: torch.Tensor | None = None, is_causal: bool = True) -> torch.Tensor:
    """The same causal attention given as an explicit boolean mask (True = may attend).

    On CUDA an explicit mask rules out SDPA's flash backend (the memory-efficient one runs instead);
    PyTorch's CPU flash kernel accepts masks. `02_efficient_mha` shows which backend ran.
    """
    if is_causal:
        attn_mask = ~_future_mask(q.size(-2), q.device)
    return sdpa_grouped(q, k, v, dropout_p, attn_mask, False)


def _causal(batch, head, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=16)
def _causal_block_mask(seq: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, seq, seq, device=device)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """FlexAttention with a causal block mask: fused only under `torch.compile`."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as flex

    if torch.compiler.is_compiling():  # traced into the graph; the eager cache below is for eager calls
        block_mask = create_block_mask(_causal, None, None, q.size(-2), q.size(-2), device=q.device)
        return flex(q, k, v, block_mask=block_mask, enable_gqa=kv_groups(q, k) > 1)
    block_mask = _causal_block_mask(q.size(-2), str(q.device))
    with warnings.catch_warnings():  # eager flex warns that it is unfused; the gallery says so
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex(q, k, v, block_mask=block_mask, enable_gqa=kv_groups(q, k) > 1)


def flash_attn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """flash-attn's FlashAttention-2; it wants (batch, seq, heads, head_dim) and shares GQA's key/value heads."""
    flash_attn = require("flash_attn", "attn_implementation='flash_attention_2'")
    out = flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     dropout_p=dropout_p, causal=True)
    return out.transpose(1, 2)


def flash_torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    from .flash_torch import flash_attention_torch

    groups = kv_groups(q, k)
    return flash_attention_torch(q, repeat_kv(k, groups), repeat_kv(v, groups), causal=True)


def flash_triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    from .flash_triton import flash_attention_triton

    groups = kv_groups(q, k)
    return flash_attention_triton(q, repeat_kv(k, groups), repeat_kv(v, groups), causal=True)


# ---- layouts written out by hand: (module, x, dropout_p) -> output (batch, seq, d_model) ----
#
# They compute GPT-2's attention from the weight matrices themselves, to show where the heads live in them; the
# kernels above run behind the module's own projection (`CausalSelfAttention.project`), which also does GQA, RoPE
# and QK-norm.


def _split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    batch, seq, _ = t.shape
    return t.view(batch, seq, heads, -1).transpose(1, 2)


def _merge_heads(m: CausalSelfAttention, y: torch.Tensor) -> torch.Tensor:
    batch, heads, seq, head_dim = y.shape
    return m.out_proj(y.transpose(1, 2).reshape(batch, seq, heads * head_dim))


def _qkv_weights(m: CausalSelfAttention, part: int, rows: slice = slice(None)):
    """Rows of the fused projection for Q (part 0), K (1) or V (2)."""
    start = part * m.d_model
    w = m.qkv.weight[start : start + m.d_model][rows]
    b = None if m.qkv.bias is None else m.qkv.bias[start : start + m.d_model][rows]
    return w, b


def _wrapper_forward(m: CausalSelfAttention, x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """A list of single-head causal attentions run one after another, outputs concatenated."""
    heads = []
    for h in range(m.n_heads):
        rows = slice(h * m.head_dim, (h + 1) * m.head_dim)
        q, k, v = (F.linear(x, *_qkv_weights(m, part, rows)) for part in range(3))
        heads.append(eager_attention(q, k, v, dropout_p))
    return m.out_proj(torch.cat(heads, dim=-1))


def _stacked_forward(m: CausalSelfAttention, x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Separate Q, K, V projections (three matmuls), each holding every head's rows stacked."""
    q, k, v = (_split_heads(F.linear(x, *_qkv_weights(m, part)), m.n_heads) for part in range(3))
    return _merge_heads(m, eager_attention(q, k, v, dropout_p))


def _einsum_forward(m: CausalSelfAttention, x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Every contraction written as an einsum over named axes (b batch, t/s positions, h heads)."""
    w = m.qkv.weight.view(3, m.n_heads, m.head_dim, -1)
    qkv = torch.einsum("btc,phdc->pbhtd", x, w)
    if m.qkv.bias is not None:
        qkv = qkv + m.qkv.bias.view(3, 1, m.n_heads, 1, m.head_dim)
    q, k, v = qkv
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(m.head_dim)
    weights = torch.softmax(scores.masked_fill(_future_mask(x.size(1), x.device), float("-inf")), dim=-1)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    context = torch.einsum("bhts,bhsd->bhtd", weights, v)
    out = torch.einsum("bhtd,ohd->bto", context, m.out_proj.weight.view(m.d_model, m.n_heads, m.head_dim))
    return out if m.out_proj.bias is None else out + m.out_proj.bias


def _nn_mha_forward(m: CausalSelfAttention, x: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """`torch.nn.MultiheadAttention` running on this module's own parameters (built on the meta
    device, so no weights are allocated, then pointed at ours)."""
    with torch.device("meta"):
        mha = nn.MultiheadAttention(m.d_model, m.n_heads, dropout=dropout_p, bias=m.qkv.bias is not None,
                                    batch_first=True)
    mha.in_proj_weight, mha.in_proj_bias, mha.out_proj = m.qkv.weight, m.qkv.bias, m.out_proj
    mha.train(m.training)
    future = _future_mask(x.size(1), x.device)
    return mha(x, x, x, attn_mask=future, need_weights=False, is_causal=True)[0]


# ---- attention over a KV cache: what a cache holds, read by the backend ----


class CachedKV(Protocol):
    """One layer's keys and values in a KV cache, as one attention call reads them: what the cache holds and how to
    read it. Every cache hands these to the model (`KVCacheView.update`; `helpers.inference.cached_attention.KVRead`
    builds them for the contiguous, paged and static caches); the model's backend attends over them
    (`AttentionBackend.attend`).

    `keys`, `values`: one layer's tensors as stored, in the compute dtype or int8 with a float32 scale per position
    and head (`key_scales`, `value_scales`; None otherwise). `slots`: the positions each sequence reads, in order: a
    slice of the position axis of (batch, kv_heads, positions, head_dim) tensors, or (batch, length) flat slot ids of
    a paged cache's (slots, kv_heads, head_dim) tensors. Which of them a query sees: `allowed` (True = may attend,
    broadcast to (batch, heads, queries, length)) where given, else the causal rule for queries at positions
    `start`, `start` + 1, .... `static`: every slot is read at every step, those not written yet masked, so a
    step's shapes never change (a compiled decode step). `queries`: the queries this read serves, a range of the
    input's positions (None: all of them); `one_token_each`: those are one token of each of the read's sequences,
    side by side in one row (the serving engine's decoding tokens), attended as a batch.
    """

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None
    slots: slice | torch.Tensor
    start: int
    allowed: torch.Tensor | None
    static: bool
    queries: slice | None
    one_token_each: bool

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Keys, values and their scales (None unless int8) at `slots`, as stored: (batch, kv_heads, length, ...)."""

    def read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` in `dtype`, (batch, kv_heads, length, head_dim): int8 dequantized."""


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                     key_scales: torch.Tensor | None = None, value_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One new query per sequence, q (batch, heads, 1, head_dim), over a cache (batch, kv_heads, slots, head_dim)
    where `allowed` (1, slots) is True, written as a multiply and a sum over the slots: compiled, each of the two
    products is one loop over the cache, which reads every cached number once, whatever the grouping of heads.
    An int8 cache passes its scales (batch, kv_heads, slots, 1): each slot's scale goes on its score and on its
    weight instead of on its numbers, q·(s k) = s (q·k) and Σ p (s v) = Σ (p s) v, so the int8 numbers are
    converted in registers as they are read, where dequantizing first writes a full-precision copy of the cache
    that attention then reads again. Scores, softmax and sums in float32 at least."""
    batch, heads, _, head_dim = q.shape
    kv_heads = keys.size(1)
    group = q.to(torch.promote_types(q.dtype, torch.float32)).view(batch, kv_heads, heads // kv_heads, 1, head_dim)
    scores = (group * keys.unsqueeze(2)).sum(-1) / head_dim**0.5  # (batch, kv_heads, group, slots)
    if key_scales is not None:
        scores = scores * key_scales.squeeze(-1).unsqueeze(2)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    if value_scales is not None:
        weights = weights * value_scales.squeeze(-1).unsqueeze(2)
    out = (weights.unsqueeze(-1) * values.unsqueeze(2)).sum(-2)  # (batch, kv_heads, group, head_dim)
    return out.reshape(batch, heads, 1, head_dim).to(q.dtype)


def causal_from(start: int, n: int, device: torch.device) -> torch.Tensor:
    """True where query i, at position start + i, may see key j (positions 0 .. start + n - 1): j <= start + i."""
    return torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start)


# ---- the backends: each owns its limits; one registry ----


@dataclass(frozen=True)
class AttentionCall:
    """What a forward pass asks of an attention backend: where it runs and what it must support.

    `cached`: attention over a KV cache (new queries against every cached key, an explicit mask); `sharded`: in a
    tensor-parallel model, whose projection layers are swapped for sharded ones; `modern`: attention with GQA, RoPE,
    QK-norm or a head width other than d_model / n_heads (chapter 8); `reshapes`: an input width d_in other than
    d_model (chapter 3's modules).
    """

    device: torch.device | str
    dtype: torch.dtype
    backward: bool = False
    dropout: float = 0.0
    cached: bool = False
    sharded: bool = False
    modern: bool = False
    reshapes: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", torch.device(self.device))


class AttentionBackend:
    """One way to compute causal attention, and what it cannot do.

    A *kernel* backend defines `kernel(q, k, v, dropout_p=0.0[, attn_mask, is_causal])` and runs behind the module's
    own projection (which also does GQA, RoPE and QK-norm); a *layout* backend defines `layout(module, x, dropout_p)`
    and computes GPT-2's attention from the weight matrices itself. The rules of each kind are here, in
    `unavailable_reason`; what only one backend cannot do is its `limits`. Over a KV cache, whatever its layout
    (contiguous, paged, static), the model asks `attend`: by default the `masked` kernel over the keys and values
    read back in the queries' dtype; a backend with its own cached or paged kernel overrides `attend`. Adding a
    backend: one subclass, decorated with `register`, and its tests.
    """

    name: str = ""
    description: str = ""
    kernel: Callable[..., torch.Tensor] | None = None
    layout: Callable[[CausalSelfAttention, torch.Tensor, float], torch.Tensor] | None = None
    supports_dropout: bool = True
    masked: bool = False  # the kernel takes an explicit mask (True = may attend), which `attend` over a KV cache needs
    transformers_name: str | None = None  # transformers' attn_implementation with the same kernel (the peer's)

    def __init__(self) -> None:
        self._served: set[AttentionCall] = set()

    def limits(self, call: AttentionCall) -> str | None:
        """Why this backend alone cannot serve `call` (device, dtype, backward...), or None."""
        return None

    @property
    def attends_caches(self) -> bool:
        """Whether it can attend over a KV cache: with a kernel that takes a mask, or with its own `attend`."""
        return self.masked or type(self).attend is not AttentionBackend.attend

    def attend(self, q: torch.Tensor, kv: CachedKV) -> torch.Tensor:
        """The queries q (batch, heads, n, head_dim) over what a KV cache holds for them (`CachedKV`); like q.

        One query per sequence over a static cache (a compiled decode step) runs `decode_attention`, which the
        compiler writes as two loops over the cache, reading an int8 cache as int8. Otherwise the cache is read
        back in q's dtype and the kernel masks it: with the cache's `allowed` where it has one; else one new token
        sees every key (no mask), a whole prompt the usual causal mask (so SDPA may pick its fastest kernel), a
        chunk after cached positions an offset causal mask (`causal_from`). Override to bring a cached or paged
        kernel of your own: `kv` has the tensors as stored (`kv.keys`, `kv.slots`, the int8 scales)."""
        if kv.static and q.size(2) == 1:
            keys, values, key_scales, value_scales = kv.stored()
            return decode_attention(q, keys, values, kv.allowed, key_scales, value_scales)
        keys, values = kv.read(q.dtype)
        n = q.size(2)
        if kv.allowed is not None:
            return self.kernel(q, keys, values, attn_mask=kv.allowed, is_causal=False)
        if n == 1:
            return self.kernel(q, keys, values, is_causal=False)
        if kv.start == 0:
            return self.kernel(q, keys, values, is_causal=True)
        return self.kernel(q, keys, values, attn_mask=causal_from(kv.start, n, q.device), is_causal=False)

    def unavailable_reason(self, call: AttentionCall) -> str | None:
        """Why this backend cannot serve `call`, or None when it can; it is never silently replaced by another."""
        if call.modern and self.kernel is None:
            return (f"{self.name} writes out GPT-2's attention from the weight matrices, without GQA, RoPE or "
                    f"QK-norm: use one of {', '.join(kernel_names())}")
        if call.sharded and self.kernel is None:
            return (f"{self.name} computes its projections from the full weight matrices itself, but tensor "
                    f"parallelism swaps the model's projection layers for sharded ones: use one of "
                    f"{', '.join(kernel_names())}")
        if call.cached and not self.attends_caches:
            able = ", ".join(name for name, b in IMPLEMENTATIONS.items() if b.attends_caches)
            return (f"{self.name} computes causal attention over a square score matrix only, and a KV cache needs "
                    f"new queries against every cached key (an explicit mask): use one of {able}")
        if call.dropout > 0.0 and not self.supports_dropout:
            return f"{self.name} has no attention dropout: use dropout=0.0, or 'sdpa'"
        return self.limits(call)

    def check(self, call: AttentionCall) -> None:
        """Raise when this backend cannot serve `call`. The forward pass asks at every step; each distinct call
        (device, dtype, training or not...) is worked out once. Under torch.compile the check runs while tracing, once
        per graph, and nothing is stored (a compiled graph cannot keep Python objects)."""
        compiling = torch.compiler.is_compiling()
        if not compiling and call in self._served:
            return
        reason = self.unavailable_reason(call)
        if reason is not None:
            raise RuntimeError(f"attn_implementation={self.name!r} cannot run here: {reason}")
        if not compiling:
            self._served.add(call)


IMPLEMENTATIONS: dict[str, AttentionBackend] = {}


def register(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """Class decorator: add one instance of `backend` to IMPLEMENTATIONS under its name."""
    if not backend.name or (backend.kernel is None) == (backend.layout is None):
        raise TypeError(f"{backend.__name__} needs a name and exactly one of `kernel` and `layout`")
    IMPLEMENTATIONS[backend.name] = backend()
    return backend


def kernel_names() -> list[str]:
    return [name for name, backend in IMPLEMENTATIONS.items() if backend.kernel is not None]


@register
class Wrapper(AttentionBackend):
    name, description = "wrapper", "single-head causal attentions in a loop, concatenated"
    layout = staticmethod(_wrapper_forward)


@register
class Stacked(AttentionBackend):
    name, description = "stacked", "separate Q, K, V projections; heads via view/transpose"
    layout = staticmethod(_stacked_forward)


@register
class Eager(AttentionBackend):
    name, description = "eager", "fused QKV projection (GPT-2's c_attn), explicit softmax(QK^T)V"
    kernel = staticmethod(eager_attention)
    masked, transformers_name = True, "eager"


@register
class Einsum(AttentionBackend):
    name, description = "einsum", "every contraction as torch.einsum"
    layout = staticmethod(_einsum_forward)


@register
class SDPA(AttentionBackend):
    name, description = "sdpa", "F.scaled_dot_product_attention(is_causal=True)"
    kernel = staticmethod(sdpa_attention)
    masked, transformers_name = True, "sdpa"


@register
class SDPAMask(AttentionBackend):
    name, description = "sdpa_mask", "F.scaled_dot_product_attention with an explicit boolean mask"
    kernel = staticmethod(sdpa_masked_attention)
    masked = True


@register
class NNMultiheadAttention(AttentionBackend):
    name, description = "nn_mha", "torch.nn.MultiheadAttention(need_weights=False)"
    layout = staticmethod(_nn_mha_forward)

    def limits(self, call: AttentionCall) -> str | None:
        if call.reshapes:
            return "nn.MultiheadAttention projects queries within embed_dim, so it needs d_in == d_model"
        return None


@register
class FlexAttention(AttentionBackend):
    name, description = "flex_attention", "FlexAttention with a causal block mask (fused when compiled)"
    kernel = staticmethod(flex_attention)
    supports_dropout = False

    def limits(self, call: AttentionCall) -> str | None:
        if call.device.type not in ("cpu", "cuda"):
            return f"FlexAttention does not run on {call.device.type}"
        if call.backward and call.device.type == "cpu":
            return "FlexAttention has no backward pass on CPU (PyTorch raises NotImplementedError)"
        return None


@register
class FlashAttention2(AttentionBackend):
    name, description = "flash_attention_2", "flash-attn's flash_attn_func (CUDA, fp16/bf16)"
    kernel = staticmethod(flash_attn_attention)
    transformers_name = "flash_attention_2"

    def limits(self, call: AttentionCall) -> str | None:
        if version_of("flash_attn") is None:
            return "flash-attn is not installed (CUDA GPUs with compute capability 8.0+ only)"
        if call.device.type != "cuda":
            return "flash-attn runs on CUDA GPUs only"
        if torch.cuda.get_device_capability(call.device) < (8, 0):
            return "flash-attn needs compute capability 8.0+ (Ampere or newer)"
        if call.dtype not in (torch.float16, torch.bfloat16):
            return f"flash-attn supports float16 and bfloat16, not {dtype_name(call.dtype)}"
        return None


@register
class FlashTorch(AttentionBackend):
    name, description = "flash_torch", "FlashAttention from scratch in PyTorch: tiles, online softmax"
    kernel = staticmethod(flash_torch_attention)
    supports_dropout = False


@register
class FlashTriton(AttentionBackend):
    name, description = "flash_triton", "FlashAttention from scratch in Triton"
    kernel = staticmethod(flash_triton_attention)
    supports_dropout = False

    def limits(self, call: AttentionCall) -> str | None:
        from .flash_triton import triton_unavailable_reason

        return triton_unavailable_reason(call.device, call.dtype)


def check_attn_implementation(name: str) -> str:
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attn_implementation {name!r}; valid names: {', '.join(IMPLEMENTATIONS)}")
    return name


def unavailable_reason(name: str, call: AttentionCall) -> str | None:
    """Why the backend called `name` cannot serve `call`, or None when it can (its own answer, looked up by name)."""
    return IMPLEMENTATIONS[check_attn_implementation(name)].unavailable_reason(call)


class KVCacheView(Protocol):
    """A KV cache as one forward pass sees it (`helpers.inference.kv_cache.KVCache`, the serving engine's `PagedBatch`,
    `helpers.inference.compiled_decode.StaticKVCache`): where the new tokens sit, and what it holds for attention.
    The model calls it and attends with its own backend; nothing else runs the layers."""

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        """Positions of the `seq` new tokens of each sequence (for the position embedding)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[CachedKV]:
        """Store the new keys and values k, v (batch, kv_heads, new, head_dim) of `layer`; return what the new
        queries read: one `CachedKV` for all of them, or one per group (a ragged batch's decoding tokens, each
        prefill chunk)."""

    def advance(self, seq: int) -> None:
        """Every layer has stored the `seq` new tokens: they are part of the cache from now on."""


def attend_cache(backend: AttentionBackend, q: torch.Tensor, reads: list[CachedKV]) -> torch.Tensor:
    """The queries q (batch, heads, seq, head_dim) over what a KV cache holds for them, through `backend`: each read
    serves the queries it names, and the outputs go back in their order (a ragged batch's groups)."""
    parts = []
    for kv in reads:
        rows = q if kv.queries is None else q[:, :, kv.queries]
        if kv.one_token_each:  # (1, heads, n, head_dim): n sequences of one token each
            parts.append(backend.attend(rows.transpose(0, 2), kv).transpose(0, 2))
        else:
            parts.append(backend.attend(rows, kv))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


class CausalSelfAttention(nn.Module):
    """Causal self-attention: a fused QKV projection, attention over all heads, an output projection.

    GPT-2's by default. `n_kv_heads` < n_heads shares each key/value head among a group of query heads (GQA; MQA at
    1), `head_dim` sets the per-head width apart from d_model (Qwen3), `qk_norm` RMS-normalises each head's queries
    and keys; RoPE's angles arrive with the input (`forward`'s `rope`), since the positions are the model's.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        attn_implementation: str = "sdpa",
        d_in: int | None = None,
        layer_idx: int = 0,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # which layer's keys and values this module reads and writes in a KV cache
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        n_kv_heads = n_kv_heads or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        self.d_in = d_model if d_in is None else d_in  # input width; a transformer block keeps d_model
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.head_dim = head_dim or d_model // n_heads
        self.attn_dropout = dropout  # on the attention weights, inside the implementation
        self.attn_implementation = check_attn_implementation(attn_implementation)
        self.qkv = nn.Linear(self.d_in, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=norm_eps) if qk_norm else None
        self.resid_dropout = nn.Dropout(dropout)

    @property
    def is_gpt2(self) -> bool:
        """GPT-2's attention: as many key/value heads as queries, d_model / n_heads wide, no QK-norm."""
        return self.n_kv_heads == self.n_heads and self.n_heads * self.head_dim == self.d_model and self.q_norm is None

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """x (batch, seq, d_in) -> q (batch, n_heads, seq, head_dim), k and v (batch, n_kv_heads, seq, head_dim):
        one fused matmul, split into heads, QK-norm and RoPE's rotation (cos, sin) applied when configured."""
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([q_width, kv_width, kv_width], dim=-1)
        q, k, v = _split_heads(q, self.n_heads), _split_heads(k, self.n_kv_heads), _split_heads(v, self.n_kv_heads)
        if self.q_norm is not None:  # in the norms' dtype: under autocast q and k arrive in bf16, the weights in fp32,
            norm_dtype = self.q_norm.weight.dtype  # and torch.rms_norm's fused kernel wants them alike
            q, k = (n(t.to(norm_dtype)).to(t.dtype) for n, t in ((self.q_norm, q), (self.k_norm, k)))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: KVCacheView | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (batch, seq, d_in) -> (batch, seq, d_model). With a `cache`, the new keys and values are stored in it and
        the queries attend over everything it holds (`cache.update`), through this module's backend (`attend`).
        `rope`: the cos and sin of the input's positions (`helpers.model.rope.rope_angles`), for RoPE models."""
        dropout_p = self.attn_dropout if self.training else 0.0
        backward = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.qkv.parameters()))
        # (autocast has no meta device: a memory plan, helpers.measure.memory_plan, replays the model there)
        autocast = x.device.type != "meta" and torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        impl = IMPLEMENTATIONS[self.attn_implementation]
        impl.check(AttentionCall(x.device, dtype, backward, dropout_p, cached=cache is not None,
                                 modern=rope is not None or not self.is_gpt2, reshapes=self.d_in != self.d_model))
        if impl.layout is not None and cache is None:
            return self.resid_dropout(impl.layout(self, x, dropout_p))
        q, k, v = self.project(x, rope)
        if cache is None:
            y = impl.kernel(q, k, v, dropout_p=dropout_p)
        else:
            y = attend_cache(impl, q, cache.update(self.layer_idx, k, v))
        return self.resid_dropout(_merge_heads(self, y))
