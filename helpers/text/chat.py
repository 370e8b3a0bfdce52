"""The chat format: a user turn and an assistant turn, each closed by an end-of-turn token, and the batches that
teach a model to answer (the loss on the answer's tokens only).

    <|user|>What does `textwrap.dedent` do?<|end|><|assistant|>Remove any common leading whitespace ...<|end|>

The three markers are special tokens added after the tokenizer's vocabulary (`with_chat_tokens`), so the model
learns one new embedding each, and a user's text, encoded as ordinary text, can never produce them: a question
that contains "<|end|>" cannot end its own turn. The model answers after `<|assistant|>` and says it has finished
by producing `<|end|>`. `CHAT_TEMPLATE` writes the same tokens from a list of messages as Jinja, the form
`transformers` and the course's HTTP server read from `tokenizer_config.json`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..model.lm_head import IGNORE_INDEX
from .bpe import BPETokenizer
from .tokenizer import with_special_tokens
from .tokenizer_files import Tokenizer, special_tokens, vocab_size

if TYPE_CHECKING:
    from .instructions import Instruction

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TOKENS = (USER, ASSISTANT, END)
CHAT_TEMPLATE = ("{% for message in messages %}"  # a system message is written as a user turn: the format has two
                 "{% if message['role'] in ('system', 'user') %}<|user|>{{ message['content'] }}<|end|>"
                 "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def with_chat_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """The same tokenizer plus the three chat markers as special tokens, numbered after its vocabulary (a model
    trained with the tokenizer needs as many new embedding rows: `helpers.GPT.resize_vocabulary`)."""
    specials = special_tokens(tokenizer)
    taken = [name for name in CHAT_TOKENS if name in specials]
    if taken:
        raise ValueError(f"the tokenizer has the chat markers already ({', '.join(taken)}); use it as it is")
    added = {name: vocab_size(tokenizer) + i for i, name in enumerate(CHAT_TOKENS)}
    if isinstance(tokenizer, BPETokenizer):
        return BPETokenizer(tokenizer.merges, tokenizer.pattern, specials | added)
    return with_special_tokens(tokenizer, added)


def marker_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The ids of USER, ASSISTANT and END; refused, saying what to do, if the tokenizer lacks them."""
    specials = special_tokens(tokenizer)
    missing = [name for name in CHAT_TOKENS if name not in specials]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)}: make it with with_chat_tokens(tokenizer)")
    return {name: specials[name] for name in CHAT_TOKENS}


def prompt_ids(tokenizer: Tokenizer, question: str) -> list[int]:
    """<|user|> question <|end|> <|assistant|>: what the model continues with its answer. The question is ordinary
    text: a marker's name in it is encoded as the characters it is made of."""
    ids = marker_ids(tokenizer)
    return [ids[USER], *tokenizer.encode_ordinary(question), ids[END], ids[ASSISTANT]]


@dataclass(frozen=True)
class ChatExample:
    """One exchange as token ids: the prompt (up to and including <|assistant|>), then the answer and <|end|>."""

    ids: list[int]
    answer_start: int  # ids[answer_start:] is the answer and its <|end|>

    def inputs_and_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Next-token inputs and targets, the targets IGNORE_INDEX wherever the next token is the prompt's: the loss
        (and so every gradient) comes from the answer and its <|end|> alone."""
        ids = torch.tensor(self.ids)
        targets = ids[1:].clone()
        targets[: self.answer_start - 1] = IGNORE_INDEX
        return ids[:-1], targets


def encode_exchange(tokenizer: Tokenizer, question: str, answer: str) -> ChatExample:
    prompt = prompt_ids(tokenizer, question)
    return ChatExample(prompt + tokenizer.encode_ordinary(answer) + [marker_ids(tokenizer)[END]], len(prompt))


def encode_exchanges(tokenizer: Tokenizer, instructions: Iterable[Instruction], max_tokens: int) -> list[ChatExample]:
    """Each question and its answer as an exchange, those longer than `max_tokens` tokens (a model's context) left
    out."""
    exchanges = (encode_exchange(tokenizer, i.question, i.answer) for i in instructions)
    return [exchange for exchange in exchanges if len(exchange.ids) <= max_tokens]


def padded_batch(examples: Sequence[ChatExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One row per example, right-padded to the longest with `pad_id` (targets IGNORE_INDEX there): each example
    sees only itself, and the padding costs compute."""
    pairs = [example.inputs_and_targets() for example in examples]
    length = max(x.numel() for x, _ in pairs)
    inputs = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    targets = torch.full((len(pairs), length), IGNORE_INDEX, dtype=torch.long)
    for row, (x, y) in enumerate(pairs):
        inputs[row, : x.numel()], targets[row, : y.numel()] = x, y
    return inputs, targets


def packed_batch(examples: Sequence[ChatExample], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples laid end to end in rows of `length` tokens, a new row where the next one does not fit (the rest
    padded): little padding, but an example's tokens also attend to the examples before it in its row."""
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    used = 0
    for example in examples:
        x, y = example.inputs_and_targets()
        if x.numel() > length:
            raise ValueError(f"an example has {x.numel()} tokens, more than a row's {length}; drop it or raise "
                             "the length")
        if used + x.numel() > length:
            rows.append([])
            used = 0
        rows[-1].append((x, y))
        used += x.numel()
    inputs = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for x, y in row:
            inputs[r, at : at + x.numel()], targets[r, at : at + y.numel()] = x, y
            at += x.numel()
    return inputs, targets


def exchange_batches(examples: Sequence[ChatExample], batch_size: int, pad_id: int) -> list[tuple[torch.Tensor,
                                                                                              torch.Tensor]]:
    """The examples in order, `batch_size` to a padded batch: fixed validation batches (a Trainer's `val`)."""
    return [padded_batch(examples[i : i + batch_size], pad_id) for i in range(0, len(examples), batch_size)]
