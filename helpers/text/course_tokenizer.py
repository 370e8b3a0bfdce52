"""The course's tokenizer: the BPE notebook 2.1 trains on the course's training documents, kept in the course's cache.

Every core notebook after 2.1 that tokenizes the course's text loads it from there, so one tokenizer runs from the
text to the KV cache: 2.2 cuts its ids into windows, 5.1 trains the GPT on them, 5.7 and 6.1 decode that model and
8.1 trains the modern decoders on the same ids. Only where GPT-2's weights are used is GPT-2's tokenizer used.

Where 2.1 has not run on this machine (a notebook opened on its own, a test), the tokenizer is trained here the
same way. Training is deterministic, so that is the tokenizer 2.1 saves; a tokenizer the learner changed in 2.1
and saved is the one the later notebooks load.
"""

from __future__ import annotations

from pathlib import Path

from ..system.files import cache_dir
from .bpe import BPETokenizer, train_bpe
from .data import document_split, load_documents
from .tokenizer_files import FILES, load_tokenizer_files, save_tokenizer_files

VAL_FRACTION, SPLIT_SEED = 0.1, 0  # as every notebook that trains on the course's text holds documents out


def course_split() -> tuple[list[str], list[str]]:
    """The course's training and validation documents (whole Language Reference topics, held out at random)."""
    return document_split(load_documents(), val_fraction=VAL_FRACTION, seed=SPLIT_SEED)


def course_tokenizer_dir(vocab_size: int) -> Path:
    """Where the course's tokenizer of `vocab_size` tokens is kept: the course's cache, `tokenizers/`."""
    return cache_dir() / "tokenizers" / f"course-bpe-{vocab_size}"


def train_course_tokenizer(vocab_size: int) -> BPETokenizer:
    """Notebook 2.1's recipe: `vocab_size` tokens (the 256 bytes, then merges) learned from the training documents
    joined by blank lines."""
    train_docs, _ = course_split()
    return train_bpe("\n\n".join(train_docs), vocab_size)


def save_course_tokenizer(tokenizer: BPETokenizer) -> Path:
    """Keep `tokenizer` as the course's tokenizer of its size, replacing one kept before. Each file is replaced in
    one step, so notebooks that save and load it at once (the same tokenizer) never read half a file. Returns the
    folder."""
    if tokenizer.special_tokens:
        raise ValueError(f"the course's tokenizer has no special tokens (its documents are separated by blank lines); "
                         f"save the tokenizer without {sorted(tokenizer.special_tokens)}")
    return save_tokenizer_files(tokenizer, course_tokenizer_dir(tokenizer.vocab_size))


def load_course_tokenizer(vocab_size: int) -> BPETokenizer:
    """The course's tokenizer of `vocab_size` tokens, as 2.1 saved it; trained by 2.1's recipe and saved where it
    is not in the cache yet."""
    directory = course_tokenizer_dir(vocab_size)
    if not all((directory / name).is_file() for name in FILES):  # the last file written is the last in FILES
        save_course_tokenizer(train_course_tokenizer(vocab_size))
    tokenizer = load_tokenizer_files(directory)
    if not isinstance(tokenizer, BPETokenizer) or tokenizer.vocab_size != vocab_size:
        raise ValueError(f"{directory} does not hold a course BPE of {vocab_size} tokens; delete the folder and run "
                         "notebook 2.1 again (or call load_course_tokenizer, which trains it)")
    return tokenizer
