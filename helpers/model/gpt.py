"""GPT-2 in one screen: embeddings, pre-LayerNorm transformer blocks, tied LM head, generation.

The same classes build the LLaMA-style decoders of chapter 8 (`GPTConfig`'s modern options): RMSNorm for LayerNorm,
RoPE for the position table, grouped-query attention, SwiGLU, no biases, QK-norm, an untied head.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from .attention import CausalSelfAttention, KVCacheView, check_attn_implementation
from .checkpointing import check_checkpointing, checkpointed
from .config import GPTConfig
from .decoding import GREEDY, Sampling, check_decoding, check_prompt, check_token_ids
from .feed_forward import feed_forward_type
from .lm_head import chunked_cross_entropy
from .norm import norm_type
from .position_encoding import position_encoding_type


def norm_layer(config: GPTConfig) -> nn.Module:
    """The norm `config.norm` names, over d_model: GPT-2's LayerNorm, LLaMA's RMSNorm or another registered one
    (`helpers.model.norm`)."""
    return norm_type(config)(config)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, attn_implementation: str, layer_idx: int = 0) -> None:
        super().__init__()
        self.ln1 = norm_layer(config)
        self.attn = CausalSelfAttention(
            config.d_model, config.n_heads, config.dropout, config.bias, attn_implementation, layer_idx=layer_idx,
            n_kv_heads=config.kv_heads, head_dim=config.head_dim, qk_norm=config.qk_norm, norm_eps=config.norm_eps,
        )
        self.ln2 = norm_layer(config)
        self.mlp = feed_forward_type(config)(config)

    def forward(self, x: torch.Tensor, cache: KVCacheView | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, rope)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-architecture language model (or a LLaMA-style one); `forward` maps token ids to next-token logits."""

    def __init__(self, config: GPTConfig, attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        # GPT-2's learned table; None for an encoding that has none (RoPE rotates queries and keys inside attention)
        self.pos_emb = position_encoding_type(config).table(config)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(config, attn_implementation, layer_idx=i) for i in range(config.n_layers)
        )
        self.ln_f = norm_layer(config)
        self.activation_checkpointing: str | None = None  # see set_activation_checkpointing
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by 1/sqrt(2 * n_layers),
        # so the residual's variance does not grow with depth.
        for block in self.blocks:
            for weight in (block.attn.out_proj.weight, *block.mlp.residual_weights()):
                nn.init.normal_(weight, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def attn_implementation(self) -> str:
        return self.blocks[0].attn.attn_implementation

    def set_attn_implementation(self, name: str) -> GPT:
        """Switch the attention kernel in place; weights are untouched."""
        check_attn_implementation(name)
        for block in self.blocks:
            block.attn.attn_implementation = name
        return self

    def resize_vocabulary(self, vocab_size: int) -> GPT:
        """Grow the token embedding (and an untied LM head) to `vocab_size` rows, for tokens added to the tokenizer
        (the chat markers, `helpers.text.chat`). Each new row starts at the mean of the others, so a new token's
        logit starts among the known ones' rather than anywhere; the known tokens' rows, and so their logits, do not
        change. In place; the config says the new size."""
        old = self.config.vocab_size
        if not isinstance(vocab_size, int) or vocab_size < old:
            raise ValueError(f"vocab_size must be an integer of at least the model's {old}, got {vocab_size!r}: "
                             "removing rows would drop tokens the model knows")

        def grown(weight: torch.Tensor) -> torch.Tensor:
            return torch.cat([weight, weight.mean(0, keepdim=True).expand(vocab_size - old, -1)]).detach()

        with torch.no_grad():
            self.tok_emb = nn.Embedding.from_pretrained(grown(self.tok_emb.weight), freeze=False)
            head = grown(self.lm_head.weight) if not self.config.tie_weights else None
            self.lm_head = nn.Linear(self.config.d_model, vocab_size, bias=False, device=self.tok_emb.weight.device,
                                     dtype=self.tok_emb.weight.dtype)
            if head is None:
                self.lm_head.weight = self.tok_emb.weight
            else:
                self.lm_head.weight.copy_(head)
        self.config = dataclasses.replace(self.config, vocab_size=vocab_size)
        return self

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; a tied LM head is counted once (as GPT-2's 124M is)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields shared tensors once
        if exclude_embeddings:
            n -= sum(e.weight.numel() for e in (self.pos_emb, self.tok_emb) if e is not None)
        return n

    def forward(self, idx: torch.Tensor, cache: KVCacheView | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab_size).

        cache: a KV cache (`helpers.inference.kv_cache.KVCache`, the serving engine's paged batch): idx holds
        only the new tokens, which attend over everything cached, and their keys and values are added to it
        (inference only).
        logits_at: positions along seq whose logits are wanted (e.g. the last one when decoding): the LM head, the
        largest matmul of a small model, then skips the others.
        A pipeline stage (`helpers.parallel.pipeline.pipeline_stage`) has no embeddings before its first stage and
        no head after its last: it then takes and returns activations (batch, seq, d_model).
        """
        x = self.hidden_states(idx, cache)
        if self.lm_head is None:
            return x
        if logits_at is not None:
            x = x[:, logits_at]
        return self.lm_head(self.ln_f(x))

    def hidden_states(self, idx: torch.Tensor, cache: KVCacheView | None = None) -> torch.Tensor:
        """The last block's output (batch, seq, d_model), before the final norm and the LM head. In training, with
        activation checkpointing on (`set_activation_checkpointing`), each block's activations are recomputed in
        the backward instead of kept."""
        if self.tok_emb is not None:
            x = self.embed(idx, cache)
        elif idx.dim() != 3 or idx.size(-1) != self.config.d_model:
            raise ValueError(f"this pipeline stage takes activations (batch, seq, {self.config.d_model}), got shape "
                             f"{tuple(idx.shape)}")
        else:
            x = idx
        encoding, rope = position_encoding_type(self.config), None
        if encoding.rotary:
            rope = encoding.angles(self.config, self.positions(x.size(1), x.device, cache))
        recompute = (self.activation_checkpointing is not None and cache is None and self.training
                     and torch.is_grad_enabled())
        for block in self.blocks:
            x = checkpointed(block, x, rope, self.activation_checkpointing) if recompute else block(x, cache, rope)
        if cache is not None:
            cache.advance(x.size(1))
        return x

    def loss_sum(self, idx: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                 vocab_size: int | None = None) -> torch.Tensor:
        """Next-token cross-entropy summed over the targets (IGNORE_INDEX skipped), with the LM head applied
        `chunk_tokens` tokens at a time (`helpers.model.lm_head`): the (batch, seq, vocab) logits never exist.
        vocab_size: only the first rows of a padded head are classes."""
        hidden = self.ln_f(self.hidden_states(idx))
        return chunked_cross_entropy(hidden, self.lm_head.weight, targets, chunk_tokens, vocab_size)

    def set_activation_checkpointing(self, mode: str | None) -> GPT:
        """Recompute activations in the backward instead of keeping them: "block" keeps each block's input only,
        "selective" also keeps the outputs of its matmuls and attention (`helpers.model.checkpointing`); None keeps
        everything. Gradients are unchanged."""
        check_checkpointing(mode)
        self.activation_checkpointing = mode
        return self

    @staticmethod
    def positions(seq: int, device: torch.device, cache: KVCacheView | None = None) -> torch.Tensor:
        """Positions of `seq` new tokens: 0 .. seq-1, or the cache's next ones."""
        return torch.arange(seq, device=device) if cache is None else cache.positions(seq, device)

    def embed(self, idx: torch.Tensor, cache: KVCacheView | None = None) -> torch.Tensor:
        """Token embeddings of `idx` (batch, seq), plus the position encoding's learned vectors (at the cache's next
        positions when given) if it has a table."""
        if idx.dim() != 2:
            raise ValueError(f"expected token ids of shape (batch, seq), got shape {tuple(idx.shape)}")
        seq = idx.size(1)
        if cache is None and seq > self.config.context_length:
            raise ValueError(
                f"input has {seq} tokens but the context length is {self.config.context_length}; "
                "truncate the input or use a config with a longer context_length"
            )
        if cache is not None and self.training and self.config.dropout > 0:
            raise ValueError("a KV cache is for inference: call model.eval() first (dropout is on)")
        check_token_ids(idx, self.config.vocab_size)
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(self.positions(seq, idx.device, cache))
        return self.drop(x)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append `max_new_tokens` tokens to `idx` (batch, seq), each picked by `sampling`
        (`helpers.model.decoding.Sampling`: greedy by default; temperature, top-k, top-p and the penalties), drawn
        with `generator` when it samples. Once the sequence is longer than the context, the model sees its last
        `context_length` tokens (a sliding window).
        """
        check_prompt(idx, self.config.vocab_size)
        check_decoding(max_new_tokens, sampling, self.config.vocab_size)
        ctx = self.config.context_length
        if idx.size(1) > ctx:
            raise ValueError(
                f"the prompt has {idx.size(1)} tokens but the context length is {ctx}; "
                f"shorten the prompt (e.g. keep its last {ctx} tokens)"
            )
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                next_id = sampling.next_token(self(idx[:, -ctx:])[:, -1, :], idx, generator)
                idx = torch.cat([idx, next_id], dim=1)
        finally:
            self.train(was_training)
        return idx
