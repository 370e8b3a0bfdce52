"""The GPT configuration: one dataclass, named presets, and validation with errors that say what to do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .feed_forward import FEED_FORWARDS
from .norm import NORMS, norm_type
from .position_encoding import POSITION_ENCODINGS, position_encoding_type

GPT2_VOCAB_SIZE = 50257
MOE_ROUTERS = ("softmax_topk", "topk_softmax")  # helpers.model.moe.route


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of a decoder-only transformer. The defaults are GPT-2; every modern option is off by default.

    Runtime choices (attention kernel, dtype) live elsewhere.
    """

    vocab_size: int = GPT2_VOCAB_SIZE
    context_length: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    dropout: float = 0.1
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    tie_weights: bool = True  # LM head shares the token-embedding matrix, as in GPT-2
    ffn_type: str = "gelu"  # a registered feed-forward (helpers.model.feed_forward): "gelu" (GPT-2), "swiglu" (gated)
    # ---- the changes from GPT-2 to LLaMA-style decoders (ch08) ----
    norm: str = "layernorm"  # a registered norm (helpers.model.norm): "layernorm" (GPT-2), "rmsnorm" (LLaMA, Qwen)
    norm_eps: float = 1e-5
    position_encoding: str = "learned"  # registered in helpers.model.position_encoding: "learned" (GPT-2), "rope"
    rope_theta: float = 10000.0  # RoPE's base: frequencies theta^(-2i/head_dim)
    n_kv_heads: int | None = None  # key/value heads: None = n_heads (MHA), fewer = GQA, 1 = MQA
    head_size: int | None = None  # per-head width when it is not d_model / n_heads (Qwen3: 128 at any width)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before RoPE (Qwen3, Gemma 3)
    ffn_hidden: int | None = None  # feed-forward hidden width: None = 4d (GELU) or ~8d/3 (SwiGLU)
    # ---- Mixture-of-Experts (ffn_type="moe", helpers.model.moe); each expert is a SwiGLU ffn_hidden wide ----
    n_experts: int = 8
    experts_per_token: int = 2  # k: the experts each token runs through
    moe_router: str = "softmax_topk"  # "softmax_topk" (Switch, DeepSeek, Qwen3-MoE) or "topk_softmax" (Mixtral)
    shared_expert: bool = False  # one more expert every token runs (DeepSeek, Qwen2-MoE)
    capacity_factor: float | None = None  # an expert takes at most factor · tokens · k / n_experts slots; None: all

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_heads", "n_layers", "n_experts",
                     "experts_per_token"):
            _check_positive(name, getattr(self, name))
        for name in ("n_kv_heads", "head_size", "ffn_hidden"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"try n_heads in {[h for h in range(1, 65) if self.d_model % h == 0]}, or set head_size"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(f"GPTConfig.n_kv_heads ({self.kv_heads}) must divide n_heads ({self.n_heads}): each "
                             "key/value head serves a group of query heads")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        for name, valid in (("ffn_type", FEED_FORWARDS), ("norm", NORMS), ("position_encoding", POSITION_ENCODINGS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown GPTConfig.{name} {getattr(self, name)!r}; valid types: {', '.join(valid)}")
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"GPTConfig.experts_per_token ({self.experts_per_token}) cannot exceed n_experts "
                             f"({self.n_experts})")
        if self.moe_router not in MOE_ROUTERS:
            raise ValueError(f"unknown GPTConfig.moe_router {self.moe_router!r}; valid: {', '.join(MOE_ROUTERS)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"GPTConfig.capacity_factor must be positive or None, got {self.capacity_factor!r}")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"GPTConfig.norm_eps and rope_theta must be positive, got {self.norm_eps!r} and "
                             f"{self.rope_theta!r}")
        encoding = position_encoding_type(self)
        if encoding.rotary and self.head_dim % 2:
            raise ValueError(f"{encoding.__name__} rotates pairs of dimensions, so head_dim must be even, got "
                             f"{self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_heads (multi-head attention) unless n_kv_heads says fewer."""
        return self.n_kv_heads or self.n_heads

    @property
    def is_gpt2(self) -> bool:
        """Whether the architecture is GPT-2's (sizes aside): its layout's norm and position encoding, no other modern
        option on."""
        in_gpt2 = all("gpt2" in part.hf_layouts for part in (norm_type(self), position_encoding_type(self)))
        return in_gpt2 and (self.kv_heads, self.head_dim, self.qk_norm, self.ffn_hidden) == (
            self.n_heads, self.d_model // self.n_heads, False, None)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> GPTConfig:
        """A named configuration, optionally with some fields changed (e.g. `dropout=0.0`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")


# What makes a GPT-2-sized model LLaMA-style: the five changes of chapter 8 (no biases, an untied head).
LLAMA_STYLE = dict(norm="rmsnorm", position_encoding="rope", ffn_type="swiglu", bias=False, tie_weights=False)

PRESETS: dict[str, GPTConfig] = {
    # The four GPT-2 sizes (Radford et al. 2019), context 1024, vocabulary 50257.
    "gpt2-small": GPTConfig(d_model=768, n_heads=12, n_layers=12),
    "gpt2-medium": GPTConfig(d_model=1024, n_heads=16, n_layers=24),
    "gpt2-large": GPTConfig(d_model=1280, n_heads=20, n_layers=36),
    "gpt2-xl": GPTConfig(d_model=1600, n_heads=25, n_layers=48),
    # Small enough to train for a few minutes on a laptop CPU.
    "gpt-cpu": GPTConfig(context_length=256, d_model=384, n_heads=6, n_layers=6, dropout=0.0),
    # Smoke scale for CI: seconds on 2 CPU cores.
    "gpt-smoke": GPTConfig(context_length=64, d_model=128, n_heads=4, n_layers=2, dropout=0.0),
    # gpt-cpu and gpt-smoke made LLaMA-style, with grouped-query attention (3 and 2 query heads per KV head).
    "llama-cpu": GPTConfig(context_length=256, d_model=384, n_heads=6, n_layers=6, dropout=0.0, n_kv_heads=2,
                           **LLAMA_STYLE),
    "llama-smoke": GPTConfig(context_length=64, d_model=128, n_heads=4, n_layers=2, dropout=0.0, n_kv_heads=2,
                             **LLAMA_STYLE),
}
