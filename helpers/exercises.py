"""Checks of the learner's answers to the exercises: each runs the attempt on inputs it makes itself, compares it with
the course's tested code, and prints whether it is right and, if not, what differs on which input.

A starter cell as given raises NotImplementedError; its check prints what to do instead of failing, so a notebook
still runs from top to bottom. Each check returns True when the attempt is right. The lines start with "Correct",
"Not yet" or "To do", never with a claim's ✓ or ✗.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from .model.attention import CausalSelfAttention
from .model.config import PRESETS, GPTConfig
from .model.gpt import GPT
from .text.bpe import BPETokenizer, gpt2_merges
from .text.tokenizer import get_tokenizer


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


def check_stream_decode(stream_decode: Callable[[Iterable[int], list[bytes]], Iterator[str]]) -> bool:
    """Chapter 2.1, exercise 5: `stream_decode(ids, token_bytes)` yields the text of `ids` in pieces, each as soon
    as its characters are complete, so no piece shows U+FFFD for a character cut between tokens."""
    tokenizer = BPETokenizer(gpt2_merges()[:2000])
    texts = ["plain ASCII text", "東京 and Zürich — 🙂 twice 🙂", "naïve café, 1½ × 3 = 4½",
             "Ελληνικά, русский, 한국어"]

    def attempt() -> str | None:
        for text in texts:
            ids = tokenizer.encode(text)
            pieces = list(stream_decode(iter(ids), tokenizer.token_bytes))
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
