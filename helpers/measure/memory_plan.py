"""Peak memory of a step on a GPU we do not have: the step's own code replayed on the meta device.

Meta tensors carry shapes and dtypes but no data, so a training step of a 1.5B-parameter model "runs" on a laptop
in seconds. `LiveTensorBytes` sees every tensor the step allocates (forward, backward, optimizer) and, through a
weak reference on each storage, when it is freed; the largest sum of live storages is the step's peak tensor
memory, what `torch.cuda.max_memory_allocated` reports on the GPU (less the allocator's rounding).

A meta replay does not see two things on its own, so the plan stands them in:

* autocast acts on CUDA and CPU tensors, not on meta ones: `AutocastPlan` casts the inputs of the functions CUDA's
  autocast runs in low precision (matmuls, attention) and of those it runs in fp32 (norms, softmax, the loss), and
  keeps each weight's cast until the forward ends, as autocast's cache does;
* on meta, SDPA takes its math path (a T x T score matrix per head); on a GPU it runs a fused kernel (flash or
  memory-efficient) that keeps only its output and one log-sum-exp per query for the backward.
  `fused_attention=True` stands such a kernel in.

What is not a tensor (the CUDA context, cuBLAS workspaces, the caching allocator's rounding and fragmentation)
is an allowance (`CUDA_CONTEXT_BYTES`, `FRAGMENTATION`) added by `MemoryPlan.required_bytes`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..inference.kv_cache import KVCache
from ..model.config import GPTConfig
from ..model.gpt import GPT
from ..system.device import DeviceCapabilities
from ..training.step import FULL, Loss, TrainingStep, autocast_context, token_loss_sum

T = TypeVar("T")
GIB = 1 << 30
CUDA_CONTEXT_BYTES = GIB  # CUDA context, cuBLAS/cuDNN workspaces and kernels loaded: 0.3-0.9 GiB on current GPUs
FRAGMENTATION = 0.10  # the caching allocator's rounding and fragmentation, as a share of the tensor peak


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of tensor storage alive now (`current`) and at most (`peak`) while the mode is on; each storage counted
    once however many views share it, and freed when its last reference (autograd's saved tensors included) goes."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._alive: set[int] = set()
        self._overflow_flags: set[int] = set()  # storages of GradScaler's found-inf flags (floats)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            # .item() of a meta tensor has no value: a flag reads False (no error path taken), a GradScaler's
            # found-inf flag 0 (no overflow: the optimizer steps), any other number 1 (an optimizer's step count,
            # which bias corrections divide by, or a loss to print)
            if args[0].dtype == torch.bool:
                return False
            return 0 if id(args[0].untyped_storage()) in self._overflow_flags else 1
        if func is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default:
            found_inf = args[1].untyped_storage()
            self._track(found_inf)
            self._overflow_flags.add(id(found_inf))
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)  # a storage's Python object lives as long as the storage itself
        if key in self._alive:
            return
        self._alive.add(key)
        size = storage.nbytes()
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self._overflow_flags.discard(key)
        self.current -= size


# The functions CUDA's autocast runs in low precision and those it runs in fp32, by name (torch.amp's op lists).
LOW_PRECISION = {"linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm", "einsum",
                 "scaled_dot_product_attention", "conv1d", "conv2d"}
FULL_PRECISION = {"layer_norm", "group_norm", "rms_norm", "softmax", "log_softmax", "cross_entropy", "nll_loss"}


class AutocastPlan(TorchFunctionMode):
    """torch.autocast's casts on meta tensors: inputs of LOW_PRECISION functions to `dtype`, of FULL_PRECISION
    ones to fp32; each leaf weight cast once per forward and kept (autocast's weight cache)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        # id of a weight (or of its storage) -> (the weight, kept alive so no other tensor takes the id; its cast)
        self._cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _cast(self, t, dtype: torch.dtype):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == dtype:
            return t
        if not (t.is_leaf and t.requires_grad and dtype == self.dtype):
            return t.to(dtype)
        if torch.is_grad_enabled():  # the cast is part of the graph: the weight's gradient flows back through it
            key = ("weight", id(t))
            if key not in self._cache:
                self._cache[key] = (t, t.to(dtype))
            return self._cache[key][1]
        # Without grad (inside the chunked head's Function, which casts its weight once itself) every view of the
        # weight, its transpose taken afresh in each chunk, shares one cast of the weight's storage.
        storage = t.untyped_storage()
        key = ("storage", id(storage))
        if key not in self._cache:
            self._cache[key] = (t, t.new_empty(0).set_(storage).to(dtype))  # the storage's elements, flat
        return self._cache[key][1].as_strided(t.shape, t.stride(), t.storage_offset())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in LOW_PRECISION or name in FULL_PRECISION:
            dtype = self.dtype if name in LOW_PRECISION else torch.float32
            args, kwargs = tree_map(lambda t: self._cast(t, dtype), (args, kwargs))
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        self._cache.clear()  # autocast drops its weight cache when the region ends
        return super().__exit__(*exc)


class FusedAttentionPlan(torch.autograd.Function):
    """The memory of a fused attention kernel (FlashAttention, memory-efficient): it saves q, k, v, its output
    and one fp32 log-sum-exp per query and head; the backward adds one fp32 value per query and head."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, lse = ctx.saved_tensors
        torch.empty_like(lse)  # rowsum(dO * O), computed before the tiles and freed after them
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FusedAttention(TorchFunctionMode):
    """Replaces F.scaled_dot_product_attention (causal, no mask) with `FusedAttentionPlan`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None:
            return FusedAttentionPlan.apply(*args[:3])
        return func(*args, **kwargs)


@dataclass(frozen=True)
class MemoryPlan:
    """A step's tensor memory, planned: `peak_bytes` at its highest, `end_bytes` still held after it."""

    peak_bytes: int
    end_bytes: int

    @property
    def required_bytes(self) -> int:
        """The peak with the allowance for what is not a tensor: what the device must offer."""
        return int(self.peak_bytes * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES

    def fits(self, caps: DeviceCapabilities, held_bytes: int = 0) -> bool:
        """True when the device's memory holds the planned step beside `held_bytes` of tensors kept from earlier
        work (`torch.cuda.memory_allocated()` in a notebook): with the allowance on a CUDA GPU, the tensors alone
        elsewhere (a CPU's or a Mac's RAM has no CUDA context)."""
        need = (self.required_bytes if caps.device_type == "cuda" else self.peak_bytes) + held_bytes
        return caps.total_memory_bytes is not None and need <= caps.total_memory_bytes

    def __str__(self) -> str:
        return f"peak {self.peak_bytes / GIB:.2f} GiB of tensors, {self.required_bytes / GIB:.2f} GiB with allowance"


def plan_memory(work: Callable[..., object], *, device: str = "meta", fused_attention: bool = True,
                setup: Callable[[], object] | None = None) -> MemoryPlan:
    """Run `work()` (which creates its tensors on the default device) on `device` and return its tensor memory.

    device: "meta" plans without running anything (`fused_attention` then stands in a GPU's fused attention);
    "cpu" runs the work for real and measures it the same way (the reference a plan is checked against).
    setup: what arrives whole before the work (a model built on the host, then moved to the GPU in its dtype):
    its tensors count as held, the temporaries of making them do not; the work is then `work(setup())`.
    """
    tracker = LiveTensorBytes()
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.device(device))
        if fused_attention and device == "meta":
            stack.enter_context(FusedAttention())
        stack.enter_context(tracker)
        if setup is None:
            kept = work()
        else:
            made = setup()
            tracker.peak = tracker.current
            kept = work(made)
            del made
        end = tracker.current
    del kept
    return MemoryPlan(tracker.peak, end)


def precision(device_type: str, autocast: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast to `autocast` (None: none), or the plan's stand-in for it on the meta device; a `TrainingStep`'s
    autocast_region."""
    if device_type == "meta" and autocast is not None:
        return AutocastPlan(autocast)
    return autocast_context(device_type, autocast)


@functools.lru_cache(maxsize=256)  # a plan replays the whole step: notebooks and tests ask for the same ones
def training_step_plan(config: GPTConfig, batch: int, seq: int, *, autocast: torch.dtype | None = None,
                       micro_batches: int = 1, fused_attention: bool = True, attn_implementation: str = "sdpa",
                       steps: int = 2, device: str = "meta", checkpointing: str | None = None, loss: Loss = FULL,
                       prepare: Callable[[GPT], GPT] | None = None) -> MemoryPlan:
    """The memory of `steps` calls of the course's `TrainingStep` on `GPT(config)`, itself and not a copy of it:
    `micro_batches` forward and backward passes of (batch, seq) tokens each under `autocast` (fp16 with its
    GradScaler), the loss `loss` (FULL, ChunkedLoss(128), ...: hashable, as plans are cached by their arguments),
    gradient clipping, then AdamW (the multi-tensor implementation a GPU uses). `end_bytes`: weights and optimizer
    state (and fp16's loss scale). device: "meta" plans (see `plan_memory`); "cpu" runs the steps and measures them.
    checkpointing: the model's activation checkpointing (`GPT.set_activation_checkpointing`). prepare: what is done
    to the model before training (`add_lora` freezes it and adds adapters): the optimizer then keeps state for the
    parameters left trainable only."""
    if checkpointing is not None and device == "meta" and (fused_attention or autocast is not None):
        raise ValueError("plan activation checkpointing in fp32 with fused_attention=False (or on a real device): "
                         "the plan's stand-ins for autocast and fused attention do not reach the recomputation")

    def work():
        model = GPT(config, attn_implementation=attn_implementation).set_activation_checkpointing(checkpointing)
        if prepare is not None:
            model = prepare(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
        step = TrainingStep(model, optimizer, loss=loss, autocast=autocast, grad_clip=1.0, autocast_region=precision)
        x = torch.zeros(batch, seq, dtype=torch.long)
        for _ in range(steps):
            step([(x, x)] * micro_batches)
        return step

    return plan_memory(work, device=device, fused_attention=fused_attention)


@functools.lru_cache(maxsize=256)
def inference_plan(config: GPTConfig, batch: int, seq: int, *, dtype: torch.dtype = torch.float32,
                   autocast: torch.dtype | None = None, cache_len: int | None = None, kv_cache_dtype: str = "auto",
                   fused_attention: bool = True, device: str = "meta") -> MemoryPlan:
    """The memory of a forward pass without gradients over (batch, seq) tokens, the weights in `dtype` (and the
    forward under `autocast`, as a timed fp32 model runs in 16 bits).

    cache_len None: an evaluation (every position's logits and the loss, in fp32 at least). Otherwise a
    generation: the prefill of `seq` prompt tokens into a KV cache of `cache_len` positions (stored as
    `kv_cache_dtype` says: "auto" or "int8"), the LM head at the last position only, then one decode step. The
    cache is allocated whole before the prefill, so this is the peak of generating up to `cache_len` positions: a
    decode step passes one token.
    `end_bytes`: the weights, and the cache. device: "meta" plans, "cpu" measures (see `plan_memory`)."""
    def work(model):
        x = torch.zeros(batch, seq, dtype=torch.long)
        with torch.no_grad(), precision(device, autocast):
            if cache_len is None:
                token_loss_sum(model(x), x)
                return model
            cache = KVCache(config, batch, cache_len, dtype, device, kv_format=kv_cache_dtype)
            last = model(x, cache=cache, logits_at=torch.tensor([seq - 1]))[:, -1]
            model(last.argmax(-1, keepdim=True), cache=cache)
            return model, cache

    return plan_memory(work, device=device, fused_attention=fused_attention,
                       setup=lambda: GPT(config).to(dtype).eval())


@functools.cache
def parameter_count(config: GPTConfig) -> int:
    """The parameters of `GPT(config)`, counted on the meta device: no memory, so GPT-2 XL's 1.5B count in a blink."""
    with torch.device("meta"):
        return GPT(config).num_parameters()


class MemoryPlanError(RuntimeError):
    """Not even the smallest candidate fits the device."""


def fitting(candidates: Iterable[T], plan: Callable[[T], MemoryPlan], caps: DeviceCapabilities,
            held_bytes: int = 0) -> list[T]:
    """The candidates (batch sizes, model presets, smallest first) whose `plan(candidate)` fits the device beside
    `held_bytes` already taken: how a notebook at the gpu scale picks what a 16 GB T4 can run as well as an 80 GB
    H100. None fitting is an error."""
    candidates = list(candidates)
    fit = [c for c in candidates if plan(c).fits(caps, held_bytes)]
    if not fit:
        memory = (caps.total_memory_bytes or 0) / GIB
        held = f" beside {held_bytes / GIB:.1f} GiB held" if held_bytes else ""
        raise MemoryPlanError(f"none of {candidates} fits {caps.name} ({memory:.1f} GiB){held}: {candidates[0]} "
                              f"needs {plan(candidates[0]).required_bytes / GIB:.1f} GiB; use a GPU with more "
                              "memory, or smaller sizes in the parameters cell")
    return fit


def largest_fitting(candidates: Iterable[int], plan: Callable[[int], MemoryPlan], caps: DeviceCapabilities,
                    held_bytes: int = 0) -> int:
    """The largest candidate size whose plan fits the device beside `held_bytes` (`fitting`)."""
    return max(fitting(candidates, plan, caps, held_bytes))
