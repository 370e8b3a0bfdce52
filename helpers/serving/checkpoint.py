"""What the server serves: a model folder in the Hugging Face layout (config.json, model.safetensors and the
tokenizer's files), so the same folder runs in the course's server and in `transformers`.

A chat request is turned into one prompt by the folder's chat template (Jinja, as `transformers` renders it). A base
model has no chat format of its own; it gets `PLAIN_CHAT_TEMPLATE`, which writes each message as "Role: text" on
its own paragraph and ends with "Assistant:", so the model continues as the assistant. A model tuned to chat
(`helpers.text.chat`) brings its template and its special tokens: what the template writes around the messages is
encoded with those tokens, what the messages say as ordinary text, so no message can open or close a turn; and its
end-of-turn token, the folder's `eos_token`, ends a reply.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..model.gpt import GPT
from ..model.hf_files import WeightsError
from ..model.hf_gpt2 import load_hf_gpt2, save_hf_gpt2
from ..model.hf_llama import load_hf_llama, save_hf_llama
from ..text.tokenizer import ENDOFTEXT
from ..text.tokenizer_files import (
    Tokenizer,
    load_tokenizer_files,
    save_tokenizer_files,
    special_tokens,
    tokenizer_config,
    vocab_size,
)

PLAIN_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}"
                       "\n\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def export_for_serving(model: GPT, tokenizer: Tokenizer, directory: str | os.PathLike, *,
                       chat_template: str = PLAIN_CHAT_TEMPLATE, eos_token: str | None = None) -> Path:
    """Write `model` (GPT-2 or Llama layout, whichever its config is) and `tokenizer` into `directory`; eos_token:
    the special token that ends a reply (default: the end-of-text token, when the tokenizer has one)."""
    if vocab_size(tokenizer) != model.config.vocab_size:
        raise ValueError(f"the tokenizer has {vocab_size(tokenizer)} tokens but the model's vocab_size is "
                         f"{model.config.vocab_size}; export the tokenizer the model was trained with")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (save_hf_gpt2 if model.config.is_gpt2 else save_hf_llama)(model, directory)
    save_tokenizer_files(tokenizer, directory, chat_template=chat_template,
                         model_max_length=model.config.context_length, eos_token=eos_token)
    return directory


@dataclass
class ServedModel:
    """A loaded model folder: the model (eval mode), its tokenizer, the name clients call it by, its chat template
    and the token that ends a text (None if the tokenizer has none)."""

    model: GPT
    tokenizer: Tokenizer
    name: str
    chat_template: str
    eos_id: int | None

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt of a chat: the messages through the chat template, ready for the assistant's reply."""
        try:
            template = ImmutableSandboxedEnvironment().from_string(self.chat_template)
            return template.render(messages=messages, add_generation_prompt=True)
        except TemplateError as err:
            raise ValueError(f"the chat template failed on these messages: {err}") from None

    def encode(self, text: str) -> list[int]:
        """Token ids of a client's text: special tokens' names are plain text there, never control tokens."""
        return self.tokenizer.encode_ordinary(text)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt of a chat as token ids: the rendered text as ordinary text, except the special tokens the
        template itself writes (found by rendering it with a marker in place of each message's content), which
        become their ids. A template with none gives `encode(render_chat(messages))`."""
        markers = [f"\x00{i}\x00" for i in range(len(messages))]
        pieces = re.split("\x00(\\d+)\x00", self.render_chat(
            [{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)]))
        if sorted(int(i) for i in pieces[1::2]) != list(range(len(messages))):
            raise ValueError("the chat template changes or drops the messages' text, so a message's special-token "
                             "names cannot be kept as plain text; use a template that writes each content as it is")
        specials = special_tokens(self.tokenizer)
        written = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True)))) if specials else None
        ids: list[int] = []
        pending = ""  # ordinary text not encoded yet: BPE sees a template's text and a message's as one string
        for i, piece in enumerate(pieces):
            if i % 2:
                pending += messages[int(piece)]["content"]
                continue
            start = 0
            for found in (written.finditer(piece) if written else ()):
                ids += self.encode(pending + piece[start:found.start()]) + [specials[found.group()]]
                pending, start = "", found.end()
            pending += piece[start:]
        return ids + self.encode(pending)


def load_for_serving(directory: str | os.PathLike, *, name: str | None = None, device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None) -> ServedModel:
    """Load a folder `export_for_serving` wrote (or any GPT-2/Llama folder with those tokenizer files)."""
    directory = Path(directory)
    config_json = directory / "config.json"
    if not config_json.is_file():
        raise WeightsError(f"{directory} has no config.json: give a folder written by "
                           "helpers.serving.checkpoint.export_for_serving")
    model_type = json.loads(config_json.read_text()).get("model_type")
    load = load_hf_gpt2 if model_type == "gpt2" else load_hf_llama
    model = load(directory, device=device, dtype=dtype).eval()
    tokenizer = load_tokenizer_files(directory)
    if vocab_size(tokenizer) != model.config.vocab_size:
        raise WeightsError(f"{directory}: the tokenizer has {vocab_size(tokenizer)} tokens but the model's vocab_size "
                           f"is {model.config.vocab_size}; the folder holds a tokenizer of another model")
    settings = tokenizer_config(directory)
    template = settings.get("chat_template") or PLAIN_CHAT_TEMPLATE
    eos = settings.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos  # (older transformers write an AddedToken's fields)
    specials = special_tokens(tokenizer)
    if eos is not None and eos not in specials:
        raise WeightsError(f"{directory}: tokenizer_config.json's eos_token {eos!r} is none of the tokenizer's special "
                           f"tokens ({', '.join(specials) or 'none'}), so a reply would never end; export the model "
                           "with export_for_serving(..., eos_token=...)")
    return ServedModel(model, tokenizer, name or directory.resolve().name, template,
                       specials.get(eos or ENDOFTEXT))
