"""The exercises' checks: a reference answer passes, a typical wrong one fails with a message that says what differs,
and the starter cell as given (NotImplementedError) is told what to do."""

import codecs

import pytest
import torch

from helpers import exercises
from helpers.model.gpt import swiglu_hidden_dim
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


def not_attempted(*args):
    raise NotImplementedError


CASES = [  # check, a reference answer, a wrong one, a phrase of the message the wrong one gets
    (exercises.check_stream_decode, stream_decode, stream_decode_each_token, "holds U+FFFD"),
    (exercises.check_tokens_per_number, tokens_per_number(range(10_000)), tokens_per_number(range(1, 10_000)),
     "cover 9,999 numbers"),
    (exercises.check_softmax_jacobian, softmax_jacobian, lambda s: torch.diag(s.softmax(-1) * (1 - s.softmax(-1))),
     "differs from autograd"),
    (exercises.check_dependence, dependence, lambda layer, x: dependence(layer, x).T, "transposed"),
    (exercises.check_parameter_count, parameter_count, lambda c: parameter_count(c) - int(c.bias) * c.d_model,
     "the model has"),
    (exercises.check_residual_stds, residual_stds, lambda model, ids: residual_stds(model, ids)[1:], "one per block"),
]


@pytest.mark.parametrize("check, right, wrong, phrase", CASES, ids=[case[0].__name__ for case in CASES])
def test_a_check_accepts_the_reference_answer_and_says_what_is_wrong_with_another(check, right, wrong, phrase,
                                                                                   capsys):
    assert check(right)
    assert capsys.readouterr().out.startswith("Correct (exercise ")
    assert not check(wrong)
    out = capsys.readouterr().out
    assert out.startswith("Not yet (exercise ") and phrase in out
    assert not check(not_attempted if callable(right) else {})
    assert capsys.readouterr().out.startswith("To do (exercise ")


def test_an_answer_that_raises_gets_the_error_as_its_verdict(capsys):
    assert not exercises.check_softmax_jacobian(lambda s: s @ "not a tensor")
    assert capsys.readouterr().out.startswith("Not yet (exercise 3.1.1, the softmax's Jacobian): your code raised")


def test_the_parameter_formula_covers_the_variants_the_exercise_names():
    configs = exercises.gpt2_family_configs()
    assert {c.ffn_type for c in configs} == {"gelu", "swiglu"} and {c.tie_weights for c in configs} == {True, False}
    assert {c.bias for c in configs} == {True, False} and len({c.d_model for c in configs}) >= 4
