"""Byte-level BPE from scratch: a hand-worked example, lossless round trips, and GPT-2's merges giving tiktoken's
tokens (the same algorithm)."""

from collections import Counter

import pytest
import regex

from helpers.text.bpe import (
    GPT2_PATTERN,
    BPETokenizer,
    gpt2_byte_characters,
    gpt2_merges,
    merge,
    pair_counts,
    train_bpe,
)
from helpers.text.data import load_corpus
from helpers.text.tokenizer import ENDOFTEXT, get_tokenizer

TRICKY = ["", " ", "  leading and trailing  ", "naïve café — 東京 🙂\n\ttabs", "don't won't it's", "x = 3.14159",
          "<|endoftext|> is text here", "\x00\x01 control bytes"]


def test_a_hand_worked_example():
    """"aaabdaaabac" (one chunk: letters only). Pair counts, overlapping: aa 4, ab 2, the rest 1 -> aa = 256,
    leaving Z a b d Z a b a c. Then Za 2 and ab 2 tie: the smaller pair (97, 98) = ab = 257 wins, leaving
    Z Y d Z Y a c. Then ZY 2 -> 258: X d X a c. Every pair is now unique, so training stops at 3 merges."""
    text = "aaabdaaabac"
    assert pair_counts({tuple(text.encode()): 1})[(97, 97)] == 4
    tok = train_bpe(text, vocab_size=300)
    assert tok.merges == [(97, 97), (97, 98), (256, 257)]
    assert tok.encode(text) == [258, 100, 258, 97, 99]
    assert tok.token_bytes[258] == b"aaab" and tok.vocab_size == 259
    assert tok.decode([258, 100, 258, 97, 99]) == text


def test_merge_is_left_to_right_without_overlaps():
    assert merge((1, 1, 1, 2, 1, 1), (1, 1), 9) == (9, 1, 2, 9)
    assert merge([5], (5, 5), 9) == (5,)


def test_chunk_counts_weight_the_pairs():
    assert pair_counts({(1, 2, 3): 5, (2, 3): 2}) == {(1, 2): 5, (2, 3): 7}


def test_training_is_deterministic_and_lossless_on_the_corpus():
    text = load_corpus()[:60_000]
    a, b = train_bpe(text, 400), train_bpe(text, 400)
    assert a.merges == b.merges and len(a.merges) == 400 - 256
    ids = a.encode(text)
    assert a.decode(ids) == text
    assert len(ids) < 0.6 * len(text.encode("utf-8"))  # 144 merges already save over 40% of the bytes
    for s in TRICKY[:-2] + TRICKY[-1:]:
        assert a.decode(a.encode(s)) == s, repr(s)


def recount_every_round(text: str, vocab_size: int, pattern: str) -> list[tuple[int, int]]:
    """The reference: chapter 2's loop, which recounts every pair of every chunk before each merge."""
    chunks = {tuple(word.encode("utf-8")): n for word, n in Counter(regex.findall(pattern, text)).items()}
    merges = []
    for new in range(256, vocab_size):
        counts = pair_counts(chunks)
        best = min(counts, key=lambda p: (-counts[p], p), default=None)
        if best is None or counts[best] < 2:
            break
        merges.append(best)
        chunks = {merge(c, best, new): n for c, n in chunks.items()}
    return merges


@pytest.mark.parametrize(("pattern", "chars", "vocab_size"), [(GPT2_PATTERN, 30_000, 856), (r"(?s).+", 8_000, 556)],
                         ids=["chunks", "one chunk"])
def test_incremental_counts_learn_the_merges_of_recounting_every_round(pattern, chars, vocab_size):
    """Kept-up-to-date counts and a heap with stale entries must pick the same pair, ties included, every round:
    over a slice of the corpus, with GPT-2's chunks and with the whole text as one chunk."""
    text = load_corpus()[:chars]
    assert train_bpe(text, vocab_size, pattern=pattern).merges == recount_every_round(text, vocab_size, pattern)


def test_merges_never_cross_a_chunk_boundary():
    tok = train_bpe("the the the the", 300)  # " the" and "the" are different chunks: never merged with a space
    assert all(b" " not in t[1:] for t in tok.token_bytes)
    assert tok.encode(" the") != tok.encode("the")


def test_special_tokens_are_refused_unless_allowed():
    tok = train_bpe("hello world " * 20, 270, special_tokens=[ENDOFTEXT])
    end = tok.special_tokens[ENDOFTEXT]
    assert end == 256 + len(tok.merges) and tok.vocab_size == end + 1
    with pytest.raises(ValueError, match="allowed_special=\\{'<\\|endoftext\\|>'\\}"):
        tok.encode(f"hello{ENDOFTEXT}world")
    ids = tok.encode(f"hello{ENDOFTEXT} world", allowed_special={ENDOFTEXT})
    assert ids.count(end) == 1 and tok.decode(ids) == f"hello{ENDOFTEXT} world"
    with pytest.raises(ValueError, match="unknown special tokens \\['<\\|im_end\\|>'\\]"):
        tok.encode("hi", allowed_special={"<|im_end|>"})


def test_bad_sizes_and_ids_say_what_to_pass():
    with pytest.raises(ValueError, match="pass at least 257"):
        train_bpe("abc", 256, special_tokens=[ENDOFTEXT])
    with pytest.raises(ValueError, match="give it an id of 257 or more"):
        BPETokenizer([(97, 98)], special_tokens={ENDOFTEXT: 256})


def test_gpt2_byte_characters_are_a_bijection_with_space_as_g_dot():
    chars = gpt2_byte_characters()
    assert len(set(chars.values())) == 256 and chars[ord(" ")] == "Ġ" and chars[ord("A")] == "A"


def test_gpt2_merges_reproduce_tiktoken_token_for_token():
    """The same algorithm: GPT-2's merges replayed by our encoder give tiktoken's tokens, byte for byte (our byte
    tokens are numbered by byte value, GPT-2's are not, so tokens are compared as bytes; merged ids agree)."""
    ours = BPETokenizer(gpt2_merges(), special_tokens={ENDOFTEXT: 50256})
    theirs = get_tokenizer()
    assert len(ours.merges) == 50_000 and ours.vocab_size == theirs.n_vocab
    for text in [load_corpus()[:40_000], *TRICKY[:6], TRICKY[-1]]:
        mine, ref = ours.encode(text), theirs.encode(text)
        assert [ours.token_bytes[t] for t in mine] == [theirs.decode_single_token_bytes(t) for t in ref], repr(text)
        assert [t for t in mine if t >= 256] == [t for t in ref if t >= 256]
    text = f"one{ENDOFTEXT}two"
    assert ours.encode(text, allowed_special={ENDOFTEXT}) == theirs.encode(text, allowed_special={ENDOFTEXT})
