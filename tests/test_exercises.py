"""The exercises' checks: a reference answer passes, a typical wrong one fails with a message that says what differs,
and the starter cell as given (NotImplementedError) is told what to do."""

import codecs
import dataclasses
import json
import math

import pytest
import torch

from helpers import exercises
from helpers.inference.kv_cache import KVCache
from helpers.model.config import GPTConfig
from helpers.model.feed_forward import swiglu_hidden_dim
from helpers.text.tokenizer import get_tokenizer


def stream_decode(ids, token_bytes):
    decoder = codecs.getincrementaldecoder("utf-8")()
    for i in ids:
        if piece := decoder.decode(token_bytes[i]):
            yield piece
    if tail := decoder.decode(b"", final=True):
        yield tail


def stream_decode_each_token(ids, token_bytes):  # decodes every token alone: a cut character becomes U+FFFD
    for i in ids:
        yield token_bytes[i].decode("utf-8", errors="replace")


def tokens_per_number(numbers):
    gpt2, counts = get_tokenizer(), {}
    for n in numbers:
        k = len(gpt2.encode_ordinary(f" {n}"))
        counts[k] = counts.get(k, 0) + 1
    return counts


def target_counts(n, context, stride):
    starts = torch.arange(0, n - context, stride)  # window s predicts tokens s + 1 .. s + context
    return torch.bincount((starts[:, None] + torch.arange(1, context + 1)).flatten(), minlength=n)


def sinusoids(positions, d):
    pos = torch.arange(positions, dtype=torch.float64)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(positions, d, dtype=torch.float64)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return table


def softmax_jacobian(scores):
    p = torch.softmax(scores, -1)
    return torch.diag(p) - torch.outer(p, p)


def dependence(fn, x):
    jac = torch.autograd.functional.jacobian(fn, x)[0, :, :, 0]
    return jac.pow(2).sum(dim=(1, 3)).sqrt()


def parameter_count(c):
    d, bias = c.d_model, int(c.bias)
    norm = d * (1 + bias)
    hidden = swiglu_hidden_dim(d) if c.ffn_type == "swiglu" else 4 * d
    ffn = (2 if c.ffn_type == "swiglu" else 1) * (d * hidden + hidden * bias) + hidden * d + d * bias
    attention = 3 * d * d + 3 * d * bias + d * d + d * bias
    head = 0 if c.tie_weights else c.vocab_size * d
    return c.vocab_size * d + c.context_length * d + c.n_layers * (2 * norm + attention + ffn) + norm + head


def residual_stds(model, ids):
    stds = []
    hooks = [block.register_forward_hook(lambda m, i, out: stds.append(out.std().item())) for block in model.blocks]
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return stds


def copied_share(generated, train_ids, n):
    seen = {tuple(train_ids[i : i + n].tolist()) for i in range(len(train_ids) - n + 1)}
    windows = [tuple(seq[i : i + n]) for seq in generated for i in range(len(seq) - n + 1)]
    return sum(w in seen for w in windows) / len(windows)


def adamw_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denominator = (exp_avg_sq / (1 - beta2**step)).sqrt() + eps
    param.sub_(lr * exp_avg / (1 - beta1**step) / denominator)


def adam_with_l2(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """The classic mistake: weight decay added to the gradient (Adam with L2), so the moments rescale it."""
    adamw_step(param, grad + weight_decay * param, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, 0.0)


def min_p_filter(logits, min_p):
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def prefill_in_chunks(model, ids, chunk):
    cache = KVCache(model.config, ids.size(0), ids.size(1), torch.float64)
    with torch.no_grad():
        logits = [model(ids[:, s : s + chunk], cache=cache) for s in range(0, ids.size(1), chunk)]
    return torch.cat(logits, dim=1), cache


def prefill_each_chunk_alone(model, ids, chunk):  # a fresh cache per chunk: later chunks see none of the earlier
    logits = []
    for s in range(0, ids.size(1), chunk):
        cache = KVCache(model.config, ids.size(0), ids.size(1), torch.float64)
        with torch.no_grad():
            logits.append(model(ids[:, s : s + chunk], cache=cache))
    return torch.cat(logits, dim=1), cache


def rope_interleaved(x, positions, theta):
    d = x.size(-1)
    angles = positions.double()[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def cache_bytes_per_token(config, fmt):
    if fmt == "int8":  # an int8 number per dimension, a float32 scale per head, for the key and the value
        return 2 * config.n_layers * (config.d_model + 4 * config.n_heads)
    return 2 * config.n_layers * config.d_model * {"float32": 4, "bfloat16": 2}[fmt]


LLAMA3_8B = GPTConfig(vocab_size=128256, context_length=8192, d_model=4096, n_heads=32, n_layers=32, n_kv_heads=8,
                      ffn_hidden=14336, norm="rmsnorm", position_encoding="rope", ffn_type="swiglu", bias=False,
                      tie_weights=False, rope_theta=500000.0, dropout=0.0)


def beam_search(model, idx, max_new_tokens, beams):  # the exercise's answer, as a learner would write it
    sequences, scores = idx, torch.zeros(1, dtype=torch.float64)
    for _ in range(max_new_tokens):
        log_probs = torch.log_softmax(model(sequences)[:, -1].double(), dim=-1)
        candidates = [(scores[i] + log_probs[i, t], i, t)
                      for i in range(len(sequences)) for t in range(log_probs.size(1))]
        kept = sorted(candidates, key=lambda c: -c[0])[:beams]
        sequences = torch.stack([torch.cat([sequences[i], torch.tensor([t])]) for _, i, t in kept])
        scores = torch.stack([score for score, _, _ in kept])
    return sequences[:1]


def beam_search_by_mean(model, idx, max_new_tokens, beams):  # wrong: ranks by each step's log-probability alone
    sequences = idx
    for _ in range(max_new_tokens):
        log_probs = torch.log_softmax(model(sequences)[:, -1].double(), dim=-1)
        candidates = [(log_probs[i, t], i, t) for i in range(len(sequences)) for t in range(log_probs.size(1))]
        kept = sorted(candidates, key=lambda c: -c[0])[:beams]
        sequences = torch.stack([torch.cat([sequences[i], torch.tensor([t])]) for _, i, t in kept])
    return sequences[:1]


def switch_loss(probs, experts):
    n_experts = probs.size(-1)
    share = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()
    return n_experts * (share * probs.mean(0)).sum()


def kept_slots(experts, n_experts, capacity_factor):
    capacity = math.ceil(capacity_factor * experts.numel() / n_experts)
    one_hot = torch.nn.functional.one_hot(experts.flatten(), n_experts)
    return ((one_hot.cumsum(0) * one_hot).sum(-1) <= capacity).view_as(experts)


def masked_targets(ids, answer_start):
    ids = torch.tensor(ids)
    targets = ids[1:].clone()
    targets[: answer_start - 1] = -100
    return ids[:-1], targets


def packed_rows(lengths, row_length):
    rows, used = 1, 0
    for n in lengths:
        if used + n > row_length:
            rows, used = rows + 1, 0
        used += n
    return rows


def lora_parameter_count(config, rank):
    d = config.d_model  # qkv d -> 3d, out_proj d -> d, fc d -> 4d, proj 4d -> d
    return config.n_layers * rank * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))


def lora_merge(weight, a, b, alpha):
    return weight + alpha / a.size(0) * b @ a


def send_after_each(pieces, stops):
    sent, held, stopped = [], "", False
    for piece in [*pieces, None]:
        text = held + (piece or "")
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if stopped or found:
            sent.append("" if stopped else text[: min(found)])
            held, stopped = "", True
            continue
        keep = 0 if piece is None else max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
                                           default=0)
        sent.append(text[: len(text) - keep])
        held = text[len(text) - keep:]
    return sent


def send_at_the_end(pieces, stops):  # the right text, but nothing until the last piece
    text = "".join(pieces)
    cut = min([i for i in (text.find(s) for s in stops) if i >= 0], default=len(text))
    return [""] * len(pieces) + [text[:cut]]


def read_stream(lines):
    text, finish, tokens = "", None, None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line.removeprefix("data: "))
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event["choices"][:1]:
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    return text, finish, tokens


def read_stream_until_finished(lines):  # stops at the finish_reason, before the usage chunk
    text, finish = "", None
    for line in lines:
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            text, finish = text + choice["text"], choice["finish_reason"]
            if finish:
                return text, finish, None
    return text, finish, None


def not_attempted(*args):
    raise NotImplementedError


CASES = [  # check, a reference answer, a wrong one, a phrase of the message the wrong one gets
    (exercises.check_stream_decode, stream_decode, stream_decode_each_token, "holds U+FFFD"),
    (exercises.check_tokens_per_number, tokens_per_number(range(10_000)), tokens_per_number(range(1, 10_000)),
     "cover 9,999 numbers"),
    (exercises.check_target_counts, target_counts, lambda n, c, s: torch.full((n,), c // s), "is a target"),
    (exercises.check_sinusoids, sinusoids, lambda p, d: sinusoids(p, d)[:, [*range(1, d, 2), *range(0, d, 2)]],
     "even columns sin"),
    (exercises.check_softmax_jacobian, softmax_jacobian, lambda s: torch.diag(s.softmax(-1) * (1 - s.softmax(-1))),
     "differs from autograd"),
    (exercises.check_dependence, dependence, lambda layer, x: dependence(layer, x).T, "transposed"),
    (exercises.check_parameter_count, parameter_count, lambda c: parameter_count(c) - int(c.bias) * c.d_model,
     "the model has"),
    (exercises.check_residual_stds, residual_stds, lambda model, ids: residual_stds(model, ids)[1:], "one per block"),
    (exercises.check_copied_share, copied_share,  # a wrong one: windows counted per sequence, short ones as 0
     lambda g, t, n: sum(copied_share([q], t, n) if len(q) >= n else 0.0 for q in g) / len(g), "occur in"),
    (exercises.check_adamw_step, adamw_step, adam_with_l2, "weight decay is decoupled"),
    (exercises.check_min_p, min_p_filter, lambda x, p: min_p_filter(x, p * 2), "the rule keeps"),
    (exercises.check_beam_search, beam_search, beam_search_by_mean, "beam search keeps"),
    (exercises.check_chunked_prefill, prefill_in_chunks, prefill_each_chunk_alone, "the cache holds 1 positions"),
    (exercises.check_interleaved_rope, rope_interleaved, lambda x, p, theta: rope_interleaved(x, p, 10000.0),
     "theta 500000"),
    (exercises.check_cache_bytes, cache_bytes_per_token,
     lambda c, fmt: 2 * c.n_layers * c.d_model if fmt == "int8" else cache_bytes_per_token(c, fmt), "scales"),
    (exercises.check_llama3_8b, LLAMA3_8B, dataclasses.replace(LLAMA3_8B, ffn_hidden=None), "SwiGLU width"),
    (exercises.check_switch_loss, switch_loss,  # a wrong one: f_e taken from the probabilities, not the choices
     lambda probs, experts: probs.size(-1) * (probs.mean(0) * probs.mean(0)).sum(), "f_e counts slots"),
    (exercises.check_kept_slots, kept_slots,  # a wrong one: the capacity counted in tokens, not token slots
     lambda experts, n, factor: kept_slots(experts, n, factor / experts.size(1)), "the rule keeps"),
    (exercises.check_masked_targets, masked_targets, lambda ids, start: masked_targets(ids, start + 1), "not"),
    (exercises.check_packed_rows, packed_rows,  # a wrong one: the tokens' rows without gaps, as if nothing were cut
     lambda lengths, row: -(-sum(lengths) // row), "packing fills"),
    (exercises.check_lora_parameter_count, lora_parameter_count,
     lambda c, r: lora_parameter_count(c, r) * 3 // 4, "rank x (in + out)"),
    (exercises.check_lora_merge, lora_merge, lambda w, a, b, alpha: w + alpha * b @ a, "(alpha / rank) B A"),
    (exercises.check_stop_strings, send_after_each, send_at_the_end, "after piece 0"),
    (exercises.check_stream_reader, read_stream, read_stream_until_finished, "completion_tokens is None"),
]


@pytest.mark.parametrize("check, right, wrong, phrase", CASES, ids=[case[0].__name__ for case in CASES])
def test_a_check_accepts_the_reference_answer_and_says_what_is_wrong_with_another(check, right, wrong, phrase,
                                                                                   capsys):
    assert check(right)
    assert capsys.readouterr().out.startswith("Correct (exercise ")
    assert not check(wrong)
    out = capsys.readouterr().out
    assert out.startswith("Not yet (exercise ") and phrase in out
    assert not check(not_attempted if callable(right) else None if isinstance(right, GPTConfig) else {})
    assert capsys.readouterr().out.startswith("To do (exercise ")


def stream_decode_at_the_end(ids, token_bytes):  # right text, no U+FFFD, but nothing until every id was read
    yield b"".join(token_bytes[i] for i in list(ids)).decode("utf-8")


def prefill_in_one_pass(model, ids, chunk):  # right logits and cache, but `chunk` ignored
    return prefill_in_chunks(model, ids, ids.size(1))


@pytest.mark.parametrize("check, wrong, phrase", [
    (exercises.check_stream_decode, stream_decode_at_the_end, "before reading token 1 it had yielded '', not 'pl'"),
    (exercises.check_chunked_prefill, prefill_in_one_pass, "with chunks of 1 the model saw passes of [40] tokens"),
], ids=["stream decoded at the end", "prefill in one pass"])
def test_an_answer_right_only_in_its_result_is_refused(check, wrong, phrase, capsys):
    """A stream that yields once at the end, or a prefill that ignores its chunk, returns what the right answer
    returns: the checks watch how it is computed too."""
    assert not check(wrong)
    out = capsys.readouterr().out
    assert out.startswith("Not yet (exercise ") and phrase in out


def packed_rows_exact_fit_moves_on(lengths, row_length):  # a row filled exactly starts a new one
    rows, used = 1, 0
    for n in lengths:
        if used and used + n >= row_length:
            rows, used = rows + 1, 0
        used += n
    return rows


def packed_rows_longest_first(lengths, row_length):  # first fit, longest first: fewer rows than packing in order
    rows = []
    for n in sorted(lengths, reverse=True):
        row = next((r for r in rows if sum(r) + n <= row_length), None)
        if row is None:
            rows.append([n])
        else:
            row.append(n)
    return len(rows)


@pytest.mark.parametrize("wrong, phrase", [
    (packed_rows_exact_fit_moves_on, "exchanges of [5, 3] tokens in rows of 8: yours fills 2 rows, packing fills 1"),
    (packed_rows_longest_first, "exchanges of [3, 6, 5, 2] tokens in rows of 8: yours fills 2 rows, packing fills 3"),
], ids=["an exact fit closing its row", "longest first"])
def test_packing_counted_refuses_rows_filled_another_way(wrong, phrase, capsys):
    assert not exercises.check_packed_rows(wrong)
    out = capsys.readouterr().out
    assert out.startswith("Not yet (exercise 9.1.2, packing, counted)") and phrase in out


def test_an_answer_that_raises_gets_the_error_as_its_verdict(capsys):
    assert not exercises.check_softmax_jacobian(lambda s: s @ "not a tensor")
    assert capsys.readouterr().out.startswith("Not yet (exercise 3.1.1, the softmax's Jacobian): your code raised")


def test_the_parameter_formula_covers_the_variants_the_exercise_names():
    configs = exercises.gpt2_family_configs()
    assert {c.ffn_type for c in configs} == {"gelu", "swiglu"} and {c.tie_weights for c in configs} == {True, False}
    assert {c.bias for c in configs} == {True, False} and len({c.d_model for c in configs}) >= 4
