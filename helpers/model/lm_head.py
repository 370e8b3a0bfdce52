"""The LM head and its cross-entropy in chunks of tokens, so the (tokens x vocabulary) logits never exist at once.

With GPT-2's 50,257-token vocabulary the logits are the largest activation of a small model: at context 1024 one
sequence's logits in fp32 take 206 MB, and a plain head keeps three tensors of that size alive around the loss (the
logits, the log-softmax saved for the backward, and its gradient). `chunked_cross_entropy` instead walks over the
tokens `chunk_tokens` at a time and, for each chunk, computes its logits, its summed loss and, right away, the
gradients that loss sends to the hidden states and to the head's weight (softmax minus one-hot, times the weight
or the hidden states). The chunk's logits are then dropped; the backward only scales the stored gradients. The
matmuls are the plain head's three (one forward, two backward), so the FLOPs are the same; the memory for logits
falls from all tokens' to one chunk's. Liger-Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy
take the same step in fused GPU kernels.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

IGNORE_INDEX = -100  # a target with this id carries no loss (padding), as in F.cross_entropy


LOGITS_CHUNK_BYTES = 32 << 20  # one chunk's fp32 logits: small beside a plain head's, large enough for fast matmuls


def chunk_tokens_for(vocab_size: int, budget_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Tokens per chunk: the largest power of two whose fp32 logits fit in `budget_bytes` (128 tokens for GPT-2's
    vocabulary at 32 MiB). Far smaller chunks are slower: the head's matmuls then have few rows each, and the
    weight's gradient is updated once per chunk."""
    if vocab_size < 1 or budget_bytes < 1:
        raise ValueError(f"need a positive vocabulary and budget, got {vocab_size} and {budget_bytes} bytes")
    return 1 << max(0, (budget_bytes // (4 * vocab_size)).bit_length() - 1)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T`, with its gradients computed chunk by chunk in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, vocab_size, ignore_index, compute_dtype):
        loss_dtype = torch.promote_types(compute_dtype, torch.float32)  # the loss in fp32 at least, as the plain head
        w = weight.to(compute_dtype)
        # The gradient's matmuls run in the compute dtype, except fp16: GradScaler scales the loss only after this
        # forward, so fp16 would flush a confident model's small probabilities (below 6e-8) to zero where the plain
        # head, whose backward sees the scaled loss, keeps them. In fp32 they are exact; under autocast the weight
        # and the hidden states already are fp32, so this costs no copy, only fp32 instead of fp16 matmuls.
        grad_dtype = loss_dtype if compute_dtype == torch.float16 else compute_dtype
        w_for_grad = w if grad_dtype == compute_dtype else weight.to(grad_dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        total = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        for start in range(0, hidden.size(0), chunk_tokens):
            h = hidden[start:start + chunk_tokens].to(compute_dtype)
            t = targets[start:start + chunk_tokens]
            logits = (h @ w.T).to(loss_dtype)
            if vocab_size < weight.size(0):  # rows of a padded head are not classes
                logits[:, vocab_size:] = -math.inf
            valid = t != ignore_index
            safe = t.masked_fill(~valid, 0)
            lse = torch.logsumexp(logits, dim=-1)
            total += ((lse - logits.gather(1, safe[:, None]).squeeze(1)) * valid).sum()
            # d(summed loss)/d(logits) = softmax - one_hot(target), zero on ignored tokens; reuses the logits' memory
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(t.size(0), device=t.device), safe] -= 1
            grad = grad.mul_(valid[:, None]).to(grad_dtype)
            grad_hidden[start:start + chunk_tokens] = grad @ w_for_grad
            h = h if grad_dtype == compute_dtype else hidden[start:start + chunk_tokens].to(grad_dtype)
            if grad_weight is None:
                grad_weight = (grad.T @ h).to(loss_dtype)
            elif grad.dtype == loss_dtype:
                grad_weight.addmm_(grad.T, h)  # in place: no second (vocab x d) tensor
            else:  # a low-precision matmul, accumulated over the chunks in fp32
                grad_weight += grad.T @ h
        # kept on ctx rather than saved: the backward hands them on and drops its reference, so autograd can
        # take them as the parameters' .grad without a copy
        ctx.grads = grad_hidden, grad_weight
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # not `del`: torch.compile traces only setting a context's attributes
        grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))  # in place: used once
        grad_weight = grad_weight.mul_(grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


# torch.compile traces the Function correctly from torch 2.13 (tested); 2.8 mixes bf16 and fp32 operands inside it
# under autocast, so older releases run it eagerly: a graph break, the same results.
CHUNKED_HEAD_TRACEABLE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _apply(hidden, weight, targets, chunk_tokens, vocab_size, ignore_index, compute_dtype):
    device_type = hidden.device.type
    autocast = torch.amp.is_autocast_available(device_type)  # not on "meta", where memory plans replay a step
    with torch.autocast(device_type, enabled=False) if autocast else contextlib.nullcontext():
        return _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), chunk_tokens,
                                                vocab_size, ignore_index, compute_dtype)


@functools.cache
def _eager_apply():
    """_apply behind torch.compiler.disable, made on first use: disable imports dynamo, and with it triton."""
    return torch.compiler.disable(_apply)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                          vocab_size: int | None = None, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), without the whole logits tensor.

    hidden: (..., d) the LM head's input (after the final norm); weight: (rows, d) the head; targets: (...) class
    ids, `ignore_index` for none. vocab_size: only the first rows are classes (a head padded to a friendlier width).
    Under torch.autocast the matmuls run in its dtype and the loss in fp32, as they do for a plain head; the
    gradients equal the plain head's (float64: to rounding; a test checks it).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be 1 or more, got {chunk_tokens}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: "
                         "pass one target per token")
    vocab_size = weight.size(0) if vocab_size is None else vocab_size
    if not 1 <= vocab_size <= weight.size(0):
        raise ValueError(f"vocab_size={vocab_size} is outside 1..{weight.size(0)} (the head's rows)")
    device_type = hidden.device.type
    compute_dtype = hidden.dtype
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    apply = _eager_apply() if not CHUNKED_HEAD_TRACEABLE and torch.compiler.is_compiling() else _apply
    return apply(hidden, weight, targets, chunk_tokens, vocab_size, ignore_index, compute_dtype)

