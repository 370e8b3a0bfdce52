"""Checks of the learner's answers to the exercises: each runs the attempt on inputs it makes itself, compares it with
the course's tested code, and prints whether it is right and, if not, what differs on which input.

A starter cell as given raises NotImplementedError; its check prints what to do instead of failing, so a notebook
still runs from top to bottom. Each check returns True when the attempt is right. The lines start with "Correct",
"Not yet" or "To do", never with a claim's ✓ or ✗.
"""

from __future__ import annotations

import codecs
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator

import torch

from .inference.kv_cache import KVCache, kv_cache_bytes_per_token
from .inference.kv_quant import kv_bytes_per_token_int8
from .model.attention import CausalSelfAttention
from .model.config import PRESETS, GPTConfig
from .model.decoding import beam_search
from .model.gpt import GPT
from .model.lm_head import IGNORE_INDEX
from .model.moe import route
from .model.rope import apply_rope
from .serving.text_stream import TextStream
from .text.bpe import BPETokenizer, gpt2_merges
from .text.chat import ChatExample, packed_batch
from .text.data import NextTokenDataset
from .text.tokenizer import get_tokenizer
from .training.lora import LoRALinear, add_lora, trainable_parameters


def report(exercise: str, attempt: Callable[[], str | None]) -> bool:
    """Run `attempt` (it returns what is wrong, or None) and print the verdict on one line."""
    try:
        wrong = attempt()
    except NotImplementedError:
        print(f"To do ({exercise}): write your answer in place of the starter's and run the cell again.")
        return False
    except Exception as err:  # the learner's code failed: say where, as the check's verdict
        print(f"Not yet ({exercise}): your code raised {type(err).__name__}: {err}")
        return False
    print(f"Correct ({exercise})." if wrong is None else f"Not yet ({exercise}): {wrong}")
    return wrong is None


def streamed(stream_decode: Callable[[Iterable[int], list[bytes]], Iterator[str]], ids: list[int],
             token_bytes: list[bytes]) -> tuple[list[str], str | None]:
    """The pieces `stream_decode` yields for `ids`, fed one at a time, and where it first held text back: before it
    reads token k, every character tokens 0..k-1 complete must have been yielded (None where it never held one back).
    """
    pieces: list[str] = []
    late: list[str] = []

    def feed() -> Iterator[int]:
        complete, shown = codecs.getincrementaldecoder("utf-8")(), ""
        for k, i in enumerate(ids):
            if not late and len("".join(pieces)) < len(shown):
                late.append(f"before reading token {k} it had yielded {''.join(pieces)!r}, not {shown!r}")
            yield i
            shown += complete.decode(token_bytes[i])

    for piece in stream_decode(feed(), token_bytes):
        pieces.append(piece)
    return pieces, late[0] if late else None


def check_stream_decode(stream_decode: Callable[[Iterable[int], list[bytes]], Iterator[str]]) -> bool:
    """Chapter 2.1, exercise 5: `stream_decode(ids, token_bytes)` yields the text of `ids` in pieces, each as soon
    as its characters are complete, so no piece shows U+FFFD for a character cut between tokens."""
    tokenizer = BPETokenizer(gpt2_merges()[:2000])
    texts = ["plain ASCII text", "東京 and Zürich — 🙂 twice 🙂", "naïve café, 1½ × 3 = 4½",
             "Ελληνικά, русский, 한국어"]

    def attempt() -> str | None:
        for text in texts:
            ids = tokenizer.encode(text)
            pieces, late = streamed(stream_decode, ids, tokenizer.token_bytes)
            if late is not None:
                return (f"{text!r}: {late}; yield each piece as soon as its characters are complete, before "
                        "reading the next token")
            if any("\ufffd" in piece for piece in pieces):
                return (f"a piece of {text!r} holds U+FFFD ({pieces!r}): keep the bytes of an unfinished character "
                        "until the next token completes it")
            if "".join(pieces) != text:
                return f"the pieces of {text!r} join to {''.join(pieces)!r}"
        return None

    return report("exercise 2.1.5, decoding a stream of tokens", attempt)


def check_tokens_per_number(answer: dict[int, int]) -> bool:
    """Chapter 2.1, exercise 4: `answer` maps a count of GPT-2 tokens to how many of the numbers 0-9999, each with a
    leading space, take that many tokens."""
    def attempt() -> str | None:
        if not answer:
            raise NotImplementedError
        gpt2 = get_tokenizer()
        truth: dict[int, int] = {}
        for n in range(10_000):
            count = len(gpt2.encode_ordinary(f" {n}"))
            truth[count] = truth.get(count, 0) + 1
        if dict(answer) != truth:
            return (f"your counts {dict(sorted(dict(answer).items()))} cover {sum(dict(answer).values()):,} numbers; "
                    f"encode each f' {{n}}' with get_tokenizer().encode_ordinary and count its tokens")
        return None

    return report("exercise 2.1.4, tokens per number", attempt)


def check_target_counts(target_counts: Callable[[int, int, int], torch.Tensor]) -> bool:
    """Chapter 2.2, exercise 1: `target_counts(n_tokens, context, stride)` is how many times each of the n tokens is
    a target in one epoch of windows of `context` tokens, `stride` apart; checked against NextTokenDataset."""
    def attempt() -> str | None:
        for n, context, stride in ((200, 16, 1), (200, 16, 16), (203, 8, 3), (50, 49, 1)):
            truth = torch.zeros(n, dtype=torch.long)
            for _, targets in NextTokenDataset(torch.arange(n), context, stride):
                truth[targets] += 1
            mine = torch.as_tensor(target_counts(n, context, stride)).long()
            if tuple(mine.shape) != (n,):
                return f"for {n} tokens the counts have shape {tuple(mine.shape)}: one count per token"
            if not torch.equal(mine, truth):
                first = int((mine != truth).nonzero()[0])
                return (f"{n} tokens, context {context}, stride {stride}: token {first} is a target "
                        f"{int(truth[first])} times, yours says {int(mine[first])}")
        return None

    return report("exercise 2.2.1, stride 1", attempt)


def check_sinusoids(sinusoids: Callable[[int, int], torch.Tensor]) -> bool:
    """Chapter 2.2, exercise 3: `sinusoids(positions, d)` is the (positions, d) table of Vaswani et al. (2017):
    column 2i holds sin(pos / 10000^(2i/d)), column 2i + 1 the cosine of the same angle."""
    def attempt() -> str | None:
        for positions, d in ((50, 16), (7, 6)):
            angle = [[pos / 10000 ** (2 * (j // 2) / d) for j in range(d)] for pos in range(positions)]
            truth = torch.tensor([[math.sin(a) if j % 2 == 0 else math.cos(a) for j, a in enumerate(row)]
                                  for row in angle], dtype=torch.float64)
            mine = torch.as_tensor(sinusoids(positions, d)).double()
            if tuple(mine.shape) != (positions, d):
                return f"sinusoids({positions}, {d}) has shape {tuple(mine.shape)}, not ({positions}, {d})"
            gap = (mine - truth).abs().max().item()
            if gap > 1e-6:
                pos, col = divmod(int((mine - truth).abs().argmax()), d)
                return (f"sinusoids({positions}, {d})[{pos}, {col}] is {mine[pos, col]:.6f}, the formula gives "
                        f"{truth[pos, col]:.6f}: even columns sin, odd columns cos, both of pos / 10000^(2i/d)")
        return None

    return report("exercise 2.2.3, sinusoidal positions", attempt)


def check_softmax_jacobian(softmax_jacobian: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Chapter 3.1, exercise 1: `softmax_jacobian(scores)` is the Jacobian of p = softmax(scores) for a 1-D
    `scores`: entry [i, j] = d p_i / d s_j."""
    generator = torch.Generator().manual_seed(0)

    def attempt() -> str | None:
        for n in (2, 5, 16):
            scores = torch.randn(n, dtype=torch.float64, generator=generator)
            truth = torch.autograd.functional.jacobian(lambda s: torch.softmax(s, -1), scores)
            mine = softmax_jacobian(scores)
            if tuple(mine.shape) != (n, n):
                return f"for {n} scores the Jacobian is {n} x {n}, yours is {tuple(mine.shape)}"
            gap = (mine.double() - truth).abs().max().item()
            if gap > 1e-9:
                return (f"for {n} scores your Jacobian differs from autograd's by up to {gap:.2e}; the diagonal is "
                        "p_i(1 - p_i), the rest -p_i p_j")
        return None

    return report("exercise 3.1.1, the softmax's Jacobian", attempt)


def check_dependence(dependence: Callable[[Callable, torch.Tensor], torch.Tensor]) -> bool:
    """Chapter 3.1, exercise 2: `dependence(fn, x)`, for a layer `fn` and x of shape (1, T, d), is the (T, T) matrix
    whose entry [t, s] is the norm of d y_t / d x_s, y = fn(x): how much output t depends on input s."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(8, 2, attn_implementation="eager").double().eval()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(layer, x)[0, :, :, 0]  # (T, d, T, d)
    truth = jac.pow(2).sum(dim=(1, 3)).sqrt()

    def attempt() -> str | None:
        mine = dependence(layer, x).double()
        if tuple(mine.shape) != tuple(truth.shape):
            return f"for T = 5 the matrix is 5 x 5, yours is {tuple(mine.shape)}"
        if torch.allclose(mine, truth.T, atol=1e-9) and not torch.allclose(mine, truth, atol=1e-9):
            return "yours is transposed: row t should be output t, column s input s"
        gap = (mine - truth).abs().max().item()
        if gap > 1e-8:
            return f"your entries differ from the Frobenius norms of autograd's Jacobian blocks by up to {gap:.2e}"
        return None

    return report("exercise 3.1.2, causality checked by gradients", attempt)


def gpt2_family_configs() -> list[GPTConfig]:
    """Every GPT-2-style preset, as is and with SwiGLU, an untied head and no biases: the configurations a
    parameter formula of chapter 4 must cover."""
    configs = []
    for name, preset in PRESETS.items():
        if not preset.is_gpt2:
            continue
        for change in ({}, {"ffn_type": "swiglu"}, {"tie_weights": False}, {"bias": False}):
            configs.append(GPTConfig.from_preset(name, **change))
    return configs


def check_parameter_count(parameter_count: Callable[[GPTConfig], int]) -> bool:
    """Chapter 4.1, exercise 1: `parameter_count(config)` from the configuration alone, for every GPT-2-style
    preset, with SwiGLU, an untied head and without biases; each checked against `helpers.GPT(config)` built on the
    meta device."""

    def attempt() -> str | None:
        for config in gpt2_family_configs():
            with torch.device("meta"):
                truth = GPT(config).num_parameters()
            mine = parameter_count(config)
            if mine != truth:
                return (f"{mine:,} parameters for {config.n_layers} layers, d_model {config.d_model}, "
                        f"ffn {config.ffn_type}, tied {config.tie_weights}, bias {config.bias}; the model has "
                        f"{truth:,} ({mine - truth:+,})")
        return None

    return report("exercise 4.1.1, the parameter count by hand", attempt)


def check_residual_stds(residual_stds: Callable[[GPT, torch.Tensor], list[float]]) -> bool:
    """Chapter 4.1, exercise 2: `residual_stds(model, ids)` is the standard deviation of the residual stream after
    each of the model's blocks, in order, for the token ids `ids` (batch, T)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, context_length=16, d_model=32, n_heads=4, n_layers=6, dropout=0.0)).eval()
    ids = torch.randint(97, (2, 16), generator=torch.Generator().manual_seed(0))
    truth = []
    hooks = [block.register_forward_hook(lambda m, inp, out: truth.append(out.std().item())) for block in model.blocks]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()

    def attempt() -> str | None:
        mine = [float(v) for v in residual_stds(model, ids)]
        if len(mine) != len(truth):
            return f"{len(mine)} values for a model of {len(truth)} blocks: one per block"
        if any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(mine, truth, strict=True)):
            return (f"yours {[round(v, 4) for v in mine]}, the blocks' outputs {[round(v, 4) for v in truth]}: "
                    "take each block's output with a forward hook on model.blocks")
        return None

    return report("exercise 4.1.2, the residual stream's growth", attempt)


def check_copied_share(copied_share: Callable[[list[list[int]], torch.Tensor, int], float]) -> bool:
    """Chapter 5.1, exercise 3: `copied_share(generated, train_ids, n)` is the share of the n-token windows of the
    generated sequences (lists of token ids) that occur somewhere in the training tokens."""
    generator = torch.Generator().manual_seed(0)
    train = torch.randint(50, (3000,), generator=generator)
    fresh = torch.randint(50, (40,), generator=generator).tolist()
    generated = [train[100:140].tolist(), fresh, train[900:920].tolist() + fresh[:20], train[5:13].tolist(), [1, 2]]

    def attempt() -> str | None:
        for n in (8, 4):
            seen = {tuple(train[i : i + n].tolist()) for i in range(len(train) - n + 1)}
            windows = [tuple(seq[i : i + n]) for seq in generated for i in range(len(seq) - n + 1)]
            truth = sum(w in seen for w in windows) / len(windows)
            mine = float(copied_share(generated, train, n))
            if abs(mine - truth) > 1e-9:
                return (f"n = {n}: yours is {mine:.4f}, {sum(w in seen for w in windows)} of the {len(windows)} "
                        f"windows of {n} tokens occur in the training tokens ({truth:.4f}); a sequence shorter than "
                        "n has no window")
        return None

    return report("exercise 5.1.3, copied or composed", attempt)


def check_adamw_step(adamw_step: Callable[..., object]) -> bool:
    """Chapter 5.1, exercise 4: `adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
    weight_decay)` updates the parameter and both moments in place, as `torch.optim.AdamW` does at its `step`-th
    update (1, 2, ...). Checked in float64 over several steps, with weight decay and without, against AdamW itself."""
    hyper = dict(lr=0.05, beta1=0.9, beta2=0.95, eps=1e-8)  # passed in this order, as the signature lists them

    def attempt() -> str | None:
        for weight_decay in (0.0, 0.1):
            generator = torch.Generator().manual_seed(0)
            reference = torch.randn(4, 3, dtype=torch.float64, generator=generator, requires_grad=True)
            optimizer = torch.optim.AdamW([reference], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                                          eps=hyper["eps"], weight_decay=weight_decay)
            param = reference.detach().clone()
            exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
            for step in range(1, 6):
                grad = torch.randn(4, 3, dtype=torch.float64, generator=generator)
                reference.grad = grad.clone()
                optimizer.step()
                before = param.clone()
                adamw_step(param, grad.clone(), exp_avg, exp_avg_sq, step, *hyper.values(), weight_decay)
                if torch.equal(param, before):
                    return "the parameter did not change: update it in place (param.sub_(...) or param -= ...)"
                gap = (param - reference.detach()).abs().max().item()
                if gap > 1e-12:
                    if weight_decay and step == 1:
                        hint = ("weight decay is decoupled: param -= lr * weight_decay * param, never added to the "
                                "gradient the moments see")
                    elif step == 1:
                        hint = ("correct the moments' bias: exp_avg / (1 - beta1**step), exp_avg_sq / "
                                "(1 - beta2**step), and add eps to the square root")
                    else:
                        hint = "keep the moments between steps: update exp_avg and exp_avg_sq in place"
                    return f"weight decay {weight_decay}, step {step}: {gap:.2e} from AdamW's parameter; {hint}"
        return None

    return report("exercise 5.1.4, AdamW by hand", attempt)


def check_beam_search(attempt_search: Callable[[GPT, torch.Tensor, int, int], torch.Tensor]) -> bool:
    """Chapter 5.7, exercise 1: `beam_search(model, idx, max_new_tokens, beams)` continues one prompt (1, seq) as
    `helpers.model.decoding.beam_search` does: keep the `beams` sequences with the largest summed log-probability
    at every step, return the best at the end, (1, seq + max_new_tokens)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=7, context_length=24, d_model=16, n_heads=2, n_layers=2, dropout=0.0)).double()
    model.eval()
    prompts = [torch.tensor([[3]]), torch.tensor([[2, 4]]), torch.tensor([[5, 1, 6, 0]])]

    def attempt() -> str | None:
        for beams in (1, 2, 4):
            for prompt in prompts:
                truth = beam_search(model, prompt, 6, beams)
                with torch.no_grad():
                    mine = attempt_search(model, prompt.clone(), 6, beams)
                if tuple(mine.shape) != tuple(truth.shape):
                    return (f"beams {beams}, prompt {prompt.tolist()[0]}: the result has shape {tuple(mine.shape)}, "
                            f"not {tuple(truth.shape)} (the prompt and the new tokens)")
                if not torch.equal(mine.cpu(), truth):
                    return (f"beams {beams}, prompt {prompt.tolist()[0]}: you return {mine[0].tolist()}, beam search "
                            f"keeps {truth[0].tolist()} (rank the sequences by the sum of their new tokens' "
                            "log-probabilities)")
        return None

    return report("exercise 5.7.1, beam search", attempt)


def check_min_p(min_p_filter: Callable[[torch.Tensor, float], torch.Tensor]) -> bool:
    """Chapter 5.7, exercise 2: `min_p_filter(logits, min_p)` keeps, in each row, the tokens whose probability is at
    least `min_p` times the row's largest, and sets the others' logits to -inf."""
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)) * 3
    logits[0] = 0.0  # every token equally likely: all are kept

    def attempt() -> str | None:
        for min_p in (0.05, 0.2, 0.9):
            probs = logits.softmax(-1)
            keep = probs >= min_p * probs.max(dim=-1, keepdim=True).values
            mine = min_p_filter(logits.clone(), min_p)
            if tuple(mine.shape) != tuple(logits.shape):
                return f"the filtered logits have shape {tuple(mine.shape)}, not {tuple(logits.shape)}"
            kept = torch.isfinite(mine)
            if not torch.equal(kept, keep):
                row = int((kept != keep).any(-1).nonzero()[0])
                return (f"min_p {min_p}, row {row}: you keep {int(kept[row].sum())} tokens, the rule keeps "
                        f"{int(keep[row].sum())} (probability >= min_p x the row's top probability)")
            if not torch.equal(mine[keep], logits[keep]):
                return f"min_p {min_p}: the kept tokens' logits changed; leave them as they are"
        return None

    return report("exercise 5.7.2, min-p", attempt)


def check_chunked_prefill(prefill_in_chunks: Callable[[GPT, torch.Tensor, int], tuple[torch.Tensor, KVCache]]) -> bool:
    """Chapter 6.1, exercise 1: `prefill_in_chunks(model, ids, chunk)` feeds the prompts `ids` (batch, P) through a
    KVCache in chunks of `chunk` tokens and returns the logits at every position (batch, P, vocab) and the cache;
    both must equal one whole-prompt pass's, in float64, for chunks of 1, 7, 16 and P tokens."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, context_length=64, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
    model = GPT(config).double().eval()
    ids = torch.randint(config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids)
        one_pass = KVCache(config, 2, ids.size(1), torch.float64)
        model(ids, cache=one_pass)
    fed: list[int] = []

    def passes(module, args, kwargs):  # the length of every pass the answer makes through the model
        fed.append((args[0] if args else kwargs["idx"]).size(1))

    def attempt() -> str | None:
        for chunk in (1, 7, 16, ids.size(1)):
            fed.clear()
            hook = model.register_forward_pre_hook(passes, with_kwargs=True)
            try:
                logits, cache = prefill_in_chunks(model, ids, chunk)
            finally:
                hook.remove()
            expected = [min(chunk, ids.size(1) - start) for start in range(0, ids.size(1), chunk)]
            if fed != expected:
                return (f"with chunks of {chunk} the model saw passes of {fed} tokens, not {expected}: feed the "
                        "prompts `chunk` tokens at a time")
            if tuple(logits.shape) != tuple(whole.shape):
                return f"with chunks of {chunk} the logits are {tuple(logits.shape)}, not {tuple(whole.shape)}"
            if cache.length != ids.size(1):
                return f"with chunks of {chunk} the cache holds {cache.length} positions, not {ids.size(1)}"
            gap = (logits.double() - whole).abs().max().item()
            if gap > 1e-10:
                return (f"with chunks of {chunk} the logits differ from one pass without a cache by up to {gap:.1e}: "
                        "feed every chunk, in order, through the same cache")
            kv_gap = max((a[:, :, : ids.size(1)] - b).abs().max().item()
                         for a, b in zip((*cache.keys, *cache.values), (*one_pass.keys, *one_pass.values), strict=True))
            if kv_gap > 1e-10:
                return f"with chunks of {chunk} the cached keys and values differ from one pass's by up to {kv_gap:.1e}"
        return None

    return report("exercise 6.1.1, prefill in chunks", attempt)


def check_interleaved_rope(rope_interleaved: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> bool:
    """Chapter 8.1, exercise 1: `rope_interleaved(x, positions, theta)` rotates each pair (2i, 2i+1) of x's last
    dimension by positions * theta^(-2i/d), RoFormer's layout; once a head's dimensions are ordered
    0, d/2, 1, d/2 + 1, ... it equals `helpers.model.rope.apply_rope` (the pairs (i, i + d/2)), in float64."""
    generator = torch.Generator().manual_seed(0)

    def reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        """apply_rope with float64 angles (rope_angles computes them in float32, 1e-7 off a float64 answer)."""
        d = x.size(-1)
        angles = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.cat([angles, angles], dim=-1)
        return apply_rope(x, angles.cos(), angles.sin())

    def attempt() -> str | None:
        for head_dim, seq, theta in ((16, 40, 10000.0), (8, 12, 500000.0)):
            half = head_dim // 2
            order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()
            x = torch.randn(2, 3, seq, head_dim, dtype=torch.float64, generator=generator)
            positions = torch.arange(seq)
            truth = reference(x, positions, theta)[..., order]
            mine = rope_interleaved(x[..., order], positions, theta)
            if tuple(mine.shape) != tuple(truth.shape):
                return f"for x of shape {tuple(x.shape)} yours returns {tuple(mine.shape)}"
            if torch.allclose(mine.double(), x[..., order]):
                return "it returns x unchanged: turn each pair (2i, 2i+1) by positions * theta**(-2i/d)"
            gap = (mine.double() - truth).abs().max().item()
            if gap > 1e-10:
                return (f"head_dim {head_dim}, theta {theta:g}: off by up to {gap:.1e}; each pair (2i, 2i+1) turns "
                        "by positions * theta**(-2i/d): (x_2i cos - x_2i+1 sin, x_2i sin + x_2i+1 cos)")
        return None

    return report("exercise 8.1.1, interleaved RoPE", attempt)


def check_cache_bytes(cache_bytes_per_token: Callable[[GPTConfig, str], int]) -> bool:
    """Chapter 6.1, exercise 3: `cache_bytes_per_token(config, fmt)` is what one token adds to a GPT-2 model's KV
    cache with keys and values stored as "float32", "bfloat16", or "int8" with a float32 scale per head and position
    (for the key and for the value), for GPT-2 small to XL; checked against the course's caches."""
    truths = {"float32": lambda c: kv_cache_bytes_per_token(c, torch.float32),
              "bfloat16": lambda c: kv_cache_bytes_per_token(c, torch.bfloat16),
              "int8": kv_bytes_per_token_int8}

    def attempt() -> str | None:
        for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"):
            for fmt, truth in truths.items():
                mine, expected = cache_bytes_per_token(PRESETS[name], fmt), truth(PRESETS[name])
                if mine != expected:
                    return (f"{name} in {fmt}: yours is {mine:,} bytes per token, the cache stores {expected:,} "
                            "(a key and a value per layer; int8 adds each one's scales)")
        return None

    return report("exercise 6.1.3, a smaller cache", attempt)


LLAMA3_8B_PARAMETERS = 8_030_261_248  # Meta's Llama-3-8B, as transformers' LlamaForCausalLM counts it


def check_llama3_8b(config: GPTConfig | None) -> bool:
    """Chapter 8.1, exercise 3: `config` is Llama-3-8B as a GPTConfig: the published parameter count (built on the
    meta device), 131,072 KV-cache bytes per token in bfloat16, and LLaMA's norm, positions and feed-forward."""
    def attempt() -> str | None:
        if config is None:
            raise NotImplementedError
        with torch.device("meta"):
            count = GPT(config).num_parameters()
        if count != LLAMA3_8B_PARAMETERS:
            return (f"{count:,} parameters, Llama-3-8B has {LLAMA3_8B_PARAMETERS:,} "
                    f"({count - LLAMA3_8B_PARAMETERS:+,}): check the SwiGLU width (ffn_hidden), the biases and the "
                    "untied head")
        kv = kv_cache_bytes_per_token(config, torch.bfloat16)
        if kv != 131_072:
            return f"{kv:,} KV-cache bytes per token in bfloat16, Llama-3-8B stores 131,072: 8 key/value heads of 128"
        shape = {"norm": "rmsnorm", "position_encoding": "rope", "ffn_type": "swiglu", "rope_theta": 500000.0}
        wrong = {key: getattr(config, key) for key, value in shape.items() if getattr(config, key) != value}
        if wrong:
            return f"the parameters match, but {wrong}: Llama 3 has {shape}"
        return None

    return report("exercise 8.1.3, Llama-3-8B counted", attempt)


def check_switch_loss(switch_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Chapter 8.3, exercise 1: `switch_loss(probs, experts)` is Switch's auxiliary loss E · Σ_e f_e · P_e (f_e the
    share of the token slots that chose expert e, P_e expert e's mean probability), as
    `helpers.model.moe.Routing.balance_loss` computes it, in float64, with gradient through P."""
    generator = torch.Generator().manual_seed(0)

    def attempt() -> str | None:
        for tokens, n_experts, k, skew in ((64, 8, 2, 0.0), (50, 4, 1, 3.0), (40, 6, 3, 1.0)):
            logits = torch.randn(tokens, n_experts, dtype=torch.float64, generator=generator)
            logits[:, 0] += skew  # a router that prefers expert 0: the loss grows above its uniform value
            logits.requires_grad_(True)
            routing = route(logits, k, "softmax_topk")
            truth = routing.balance_loss()
            mine = switch_loss(routing.probs, routing.experts)
            if not isinstance(mine, torch.Tensor) or mine.numel() != 1:
                return f"it should return a tensor holding one number, got {mine!r}"
            gap = abs(mine.double().item() - truth.item())
            if gap > 1e-10:
                return (f"{tokens} tokens, {n_experts} experts, k={k}: yours gives {mine.item():.6f}, the loss is "
                        f"{truth.item():.6f}; f_e counts slots (tokens x k of them), P_e averages probabilities over "
                        "the tokens, and the sum is multiplied by E")
            if not mine.requires_grad:
                return "the value is right but carries no gradient: the router learns through P_e"
            (grad_truth,) = torch.autograd.grad(truth, logits, retain_graph=True)
            (grad_mine,) = torch.autograd.grad(mine, logits)
            if (grad_mine - grad_truth).abs().max().item() > 1e-10:
                return ("the value is right but its gradient differs: only P_e carries one (f_e counts the choices, "
                        "which have none)")
        return None

    return report("exercise 8.3.1, Switch's balance loss", attempt)


def check_kept_slots(kept_slots: Callable[[torch.Tensor, int, float], torch.Tensor]) -> bool:
    """Chapter 8.3, exercise 2: `kept_slots(experts, n_experts, capacity_factor)` marks the token slots an expert
    keeps, at most ⌈capacity_factor · slots / n_experts⌉ each, in token order then choice order, as
    `helpers.model.moe.route` does."""
    generator = torch.Generator().manual_seed(0)

    def attempt() -> str | None:
        for tokens, n_experts, k, factor in ((64, 8, 2, 1.0), (30, 4, 1, 1.25), (48, 6, 3, 0.5), (20, 4, 2, 4.0)):
            logits = torch.randn(tokens, n_experts, generator=generator)
            logits[:, 0] += 1.5  # expert 0 is popular: it overflows
            truth = route(logits, k, "softmax_topk", capacity_factor=factor)
            mine = kept_slots(truth.experts, n_experts, factor)
            if not isinstance(mine, torch.Tensor) or tuple(mine.shape) != tuple(truth.kept.shape):
                shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
                return f"it should return a (tokens, k) = {tuple(truth.kept.shape)} mask, got {shape}"
            if not torch.equal(mine.bool(), truth.kept):
                capacity = math.ceil(factor * tokens * k / n_experts)
                counts = f"yours keeps {int(mine.bool().sum())} slots, the rule keeps {int(truth.kept.sum())}"
                if int(mine.bool().sum()) == int(truth.kept.sum()):
                    counts = "yours keeps as many slots as the rule but not the same ones"
                return (f"{tokens} tokens, {n_experts} experts, k={k}, factor {factor}: {counts} (capacity "
                        f"{capacity} slots an expert, its first ones in token order)")
        return None

    return report("exercise 8.3.2, capacity", attempt)


def check_masked_targets(masked_targets: Callable[[list[int], int], tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Chapter 9.1, exercise 1: `masked_targets(ids, answer_start)` gives an exchange's next-token inputs and
    targets, the targets IGNORE_INDEX wherever the next token is the prompt's, as `ChatExample.inputs_and_targets`
    does."""
    exchanges = [ChatExample([7, 3, 9, 4, 1, 5, 2], 4), ChatExample([1, 2, 3], 1), ChatExample([6, 8, 5, 3, 2], 4)]

    def attempt() -> str | None:
        for exchange in exchanges:
            truth = exchange.inputs_and_targets()
            mine = masked_targets(list(exchange.ids), exchange.answer_start)
            for what, m, t in zip(("inputs", "targets"), mine, truth, strict=True):
                m = torch.as_tensor(m)
                if m.tolist() != t.tolist():
                    return (f"ids {exchange.ids}, answer from {exchange.answer_start}: your {what} are {m.tolist()}, "
                            f"not {t.tolist()} (targets are ids[1:], IGNORE_INDEX = {IGNORE_INDEX} where the next "
                            "token is still the prompt's)")
        return None

    return report("exercise 9.1.1, the mask", attempt)


def check_packed_rows(packed_rows: Callable[[list[int], int], int]) -> bool:
    """Chapter 9.1, exercise 2: `packed_rows(lengths, row_length)` is how many rows `packed_batch` fills with
    exchanges of these input lengths, laid end to end in their order, a new row where the next one does not fit."""
    generator = torch.Generator().manual_seed(0)
    cases = [([5, 3], 8), ([3, 6, 5, 2], 8), ([5, 4, 5, 4], 8), ([2, 2, 2, 2, 2], 4), ([7], 7)]
    cases += [(torch.randint(1, 17, (n,), generator=generator).tolist(), 16) for n in (10, 25, 40)]

    def attempt() -> str | None:
        for lengths, row_length in cases:
            exchanges = [ChatExample(list(range(n + 1)), 1) for n in lengths]  # n inputs: n + 1 ids
            truth = packed_batch(exchanges, row_length, pad_id=0)[0].size(0)
            mine = packed_rows(list(lengths), row_length)
            if mine != truth:
                return (f"exchanges of {lengths} tokens in rows of {row_length}: yours fills {mine} rows, packing "
                        f"fills {truth} (in their order; a new row where the next exchange does not fit, an exact "
                        "fit stays in its row)")
        return None

    return report("exercise 9.1.2, packing, counted", attempt)


def check_lora_parameter_count(lora_parameter_count: Callable[[GPTConfig, int], int]) -> bool:
    """Chapter 9.2, exercise 1: `lora_parameter_count(config, rank)` is what `add_lora` trains on GPT(config) when
    it adapts every block's four Linear layers, without token rows (GPT-2's sizes, ranks 1 to 64)."""
    def attempt() -> str | None:
        for name in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"):
            for rank in (1, 8, 64):
                with torch.device("meta"):
                    truth = trainable_parameters(add_lora(GPT(PRESETS[name]), rank))
                mine = lora_parameter_count(PRESETS[name], rank)
                if mine != truth:
                    return (f"{name} at rank {rank}: yours is {mine:,}, LoRA trains {truth:,} "
                            "(rank x (in + out) per adapted layer, four layers per block)")
        return None

    return report("exercise 9.2.1, LoRA's parameters", attempt)


def check_lora_merge(merge: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]) -> bool:
    """Chapter 9.2, exercise 2: `merge(weight, a, b, alpha)` is the plain weight of a LoRA layer, as
    `LoRALinear.merged` folds it: W + (alpha / rank) B A."""
    generator = torch.Generator().manual_seed(0)

    def attempt() -> str | None:
        for rank, alpha in ((1, 1.0), (4, 8.0), (8, 32.0)):
            layer = LoRALinear(torch.nn.Linear(12, 6, dtype=torch.float64), rank, alpha)
            with torch.no_grad():
                layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=generator, dtype=torch.float64))
            truth = layer.merged().weight.detach()
            mine = merge(layer.base.weight.detach().clone(), layer.lora_a.detach().clone(),
                         layer.lora_b.detach().clone(), alpha)
            if tuple(mine.shape) != tuple(truth.shape):
                return f"rank {rank}: the merged weight has shape {tuple(mine.shape)}, not {tuple(truth.shape)}"
            gap = (mine - truth).abs().max().item()
            if gap > 1e-12:
                return (f"rank {rank}, alpha {alpha:g}: off by up to {gap:.1e}; the update is (alpha / rank) B A, "
                        "B (out x rank) times A (rank x in)")
        return None

    return report("exercise 9.2.2, merging", attempt)


def check_stop_strings(send_after_each: Callable[[list[str], list[str]], list[str]]) -> bool:
    """Chapter 6.8, exercise 1: `send_after_each(pieces, stops)` gives, for each decoded piece in turn and then once
    at the end, the text a server may send then: all of it but a tail that could begin a stop string, and nothing
    from the first stop string on, as `helpers.serving.text_stream.TextStream` sends it."""
    rng = random.Random(0)
    cases = [(["Hello", " wor", "ld", "\nUs", "er:", " more"], ["\nUser:"]),
             (["a", "b", "c", "d"], ["bc"]),
             (["The ", "end", " is ", "E", "N", "D", " here"], ["END", "here"]),
             (["xx", "x-", "-y", "yy"], ["--", "x--y"]),
             (["no stop ", "in this ", "text"], ["STOP"])]
    alphabet = ["a", "b", "ab", "ba", "c", "abc", " "]
    cases += [([rng.choice(alphabet) for _ in range(12)], ["abab", "cb"]) for _ in range(20)]

    def attempt() -> str | None:
        for pieces, stops in cases:
            stream = TextStream(lambda i, pieces=pieces: pieces[i].encode(), stops)
            truth = [stream.push(i) for i in range(len(pieces))] + [stream.finish()]
            mine = send_after_each(list(pieces), list(stops))
            if not isinstance(mine, list) or len(mine) != len(truth):
                return (f"return a list of {len(truth)} strings: one after each of the {len(pieces)} pieces, one at "
                        "the end")
            for k, (sent, right) in enumerate(zip(mine, truth, strict=True)):
                if sent != right:
                    when = f"after piece {k} ({pieces[k]!r})" if k < len(pieces) else "at the end"
                    return (f"pieces {pieces!r}, stops {stops!r}: {when} yours sends {sent!r}, the server sends "
                            f"{right!r}; hold back only a tail that could begin a stop string")
        return None

    return report("exercise 6.8.1, stop strings across tokens", attempt)


def completion_stream(pieces: list[str], finish_reason: str, usage: bool) -> list[str]:
    """The lines of a streamed /v1/completions response in OpenAI's format, with what a server may add between
    events: blank lines, a comment (a keep-alive), a last chunk with no text, and the usage in a chunk of its own."""
    def event(choices, **extra):
        return "data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices,
                                      **extra})

    lines = [": keep-alive", ""]
    for piece in pieces:
        lines += [event([{"index": 0, "text": piece, "finish_reason": None}]), ""]
    lines += [event([{"index": 0, "text": "", "finish_reason": finish_reason}]), ""]
    if usage:
        lines += [event([], usage={"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(
            pieces)}), ""]
    return lines + ["data: [DONE]", ""]


def check_stream_reader(read_stream: Callable[[list[str]], tuple[str, str | None, int | None]]) -> bool:
    """Chapter 6.8, exercise 2: `read_stream(lines)` reads the lines of a streamed completion and returns its text,
    its finish_reason and the completion tokens its usage chunk reports (None without one)."""
    cases = [(["Hello", ",", " world"], "length", True), (["data: is text", "\n\n", "é", "日本"], "stop", True),
             (["one"], "stop", False), ([], "length", True)]

    def attempt() -> str | None:
        for pieces, finish, usage in cases:
            truth = ("".join(pieces), finish, len(pieces) if usage else None)
            mine = read_stream(completion_stream(pieces, finish, usage))
            if not isinstance(mine, tuple) or len(mine) != 3:
                return "return a tuple (text, finish_reason, completion_tokens)"
            for name, got, right in zip(("text", "finish_reason", "completion_tokens"), mine, truth, strict=True):
                if got != right:
                    hint = {"text": "join the text of every chunk's first choice; a data line's JSON may hold "
                                    "'data: ' and newlines of its own",
                            "finish_reason": "the last chunk with a choice says why the text ended",
                            "completion_tokens": "the usage comes in a chunk of its own, with no choices, after "
                                                 "the last text; None if the stream has none"}[name]
                    return f"the stream of {pieces!r}: {name} is {got!r}, not {right!r} ({hint})"
        return None

    return report("exercise 6.8.2, reading a stream", attempt)
