import socket
from pathlib import Path

import pytest
import tiktoken_ext.openai_public

from helpers.text.tokenizer import GPT2_FILE_SHA256, get_tokenizer

TEXT = "Hello, do you like tea? <|endoftext|> In the sunlit terraces"
IDS = [15496, 11, 466, 345, 588, 8887, 30, 220, 50256, 554, 262, 4252, 18250, 8812, 2114]


@pytest.fixture
def offline(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    get_tokenizer.cache_clear()
    yield
    get_tokenizer.cache_clear()


def test_gpt2_ids_offline(offline):
    enc = get_tokenizer()
    assert enc.encode(TEXT, allowed_special={"<|endoftext|>"}) == IDS
    assert enc.decode(IDS) == TEXT
    assert enc.n_vocab == 50257 and enc.eot_token == 50256


def test_pinned_hashes_are_the_ones_tiktoken_pins():
    source = Path(tiktoken_ext.openai_public.__file__).read_text()
    for digest in GPT2_FILE_SHA256.values():
        assert digest in source


def test_special_token_is_refused_unless_allowed():
    with pytest.raises(ValueError):
        get_tokenizer().encode(TEXT)


def test_round_trip_of_unicode_and_whitespace():
    enc = get_tokenizer()
    text = "naïve café — 東京\n\n    indented\tcode()"
    assert enc.decode(enc.encode(text)) == text
