"""The GPT configuration: one dataclass, named presets, and validation with errors that say what to do."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GPT2_VOCAB_SIZE = 50257
FFN_TYPES = ("gelu", "swiglu")  # GPT-2's GELU MLP; the gated SiLU unit of PaLM and LLaMA


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of a GPT-2-style model. Runtime choices (attention kernel, dtype) live elsewhere."""

    vocab_size: int = GPT2_VOCAB_SIZE
    context_length: int = 1024
    d_model: int = 768
    n_heads: int = 12
    n_layers: int = 12
    dropout: float = 0.1
    bias: bool = True  # biases in Linear and LayerNorm layers, as in GPT-2
    tie_weights: bool = True  # LM head shares the token-embedding matrix, as in GPT-2
    ffn_type: str = "gelu"  # feed-forward: "gelu" (GPT-2) or "swiglu" (same parameter count, gated)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "d_model", "n_heads", "n_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"try n_heads in {[h for h in range(1, 65) if self.d_model % h == 0]}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.ffn_type not in FFN_TYPES:
            raise ValueError(f"unknown GPTConfig.ffn_type {self.ffn_type!r}; valid types: {', '.join(FFN_TYPES)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_preset(cls, name: str, **overrides) -> GPTConfig:
        """A named configuration, optionally with some fields changed (e.g. `dropout=0.0`)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


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
}
