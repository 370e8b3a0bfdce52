"""Text corpora and next-token datasets.

The default corpus comes from installed software, so the course runs offline: the Python Language
Reference text that CPython ships for `help()` (`pydoc_data.topics`, about 0.47 MB of English
prose and code). Downloadable corpora are optional, cached, and verified by sha256.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from ..system.files import atomic_path, cache_dir


@dataclass(frozen=True)
class RemoteText:
    """A text file on the web, pinned by its sha256 so a changed or damaged copy is refused."""

    url: str
    sha256: str
    filename: str


DEFAULT_CORPUS = "python-docs"
REMOTE_CORPORA = {
    # Karpathy's char-rnn Tiny Shakespeare: 1,115,394 bytes.
    "tiny-shakespeare": RemoteText(
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        filename="tiny-shakespeare.txt",
    ),
}
CORPORA = (DEFAULT_CORPUS, *REMOTE_CORPORA)


class DownloadError(RuntimeError):
    """A corpus could not be fetched or did not match its pinned checksum."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(remote: RemoteText, directory: Path | None = None, timeout: float = 30.0) -> Path:
    """Return the cached, verified copy of `remote`, downloading it once (written atomically)."""
    directory = cache_dir() if directory is None else Path(directory)
    dest = directory / remote.filename
    if dest.exists() and _sha256(dest.read_bytes()) == remote.sha256:
        return dest
    try:
        with urllib.request.urlopen(remote.url, timeout=timeout) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as err:
        raise DownloadError(
            f"could not download {remote.url} ({err}); offline? Use the default corpus "
            f"{DEFAULT_CORPUS!r}, or place the file at {dest} (sha256 {remote.sha256})"
        ) from err
    if _sha256(data) != remote.sha256:
        raise DownloadError(
            f"{remote.url} does not match its pinned sha256 {remote.sha256} (got {_sha256(data)}); "
            "the download is damaged or the file changed upstream: retry, or use another corpus"
        )
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
    return dest


def load_documents(name: str = DEFAULT_CORPUS) -> list[str]:
    """A corpus as its documents: the Language Reference's topics (in the order of their names), or a downloaded
    text's paragraphs (split at blank lines)."""
    if name == DEFAULT_CORPUS:
        try:
            from pydoc_data.topics import topics
        except ImportError as err:
            raise RuntimeError(
                "this Python lacks pydoc_data (some Linux distributions ship it separately, e.g. in "
                "libpython3-stdlib); install it, or use load_corpus('tiny-shakespeare') when online"
            ) from err
        return [topics[key] for key in sorted(topics)]
    if name in REMOTE_CORPORA:
        return fetch(REMOTE_CORPORA[name]).read_text(encoding="utf-8").split("\n\n")
    raise ValueError(f"unknown corpus {name!r}; valid corpora: {', '.join(CORPORA)}")


def load_corpus(name: str = DEFAULT_CORPUS) -> str:
    """The text of a corpus: "python-docs" (offline, default) or a downloadable one; documents are separated by a
    blank line."""
    return "\n\n".join(load_documents(name))


def train_val_split(ids: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a token stream into a leading training part and a trailing validation part."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(ids) * (1.0 - val_fraction))
    return ids[:cut], ids[cut:]


def document_split(documents: list[str], val_fraction: float = 0.1, seed: int = 0) -> tuple[list[str], list[str]]:
    """Whole documents for validation, drawn in a seeded random order while they fit in `val_fraction` of the
    characters; the rest, in their order, for training.

    Holding out whole documents from all over the corpus, rather than its last part, makes the validation text as
    varied as the training text, and no document is seen in both."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(documents) < 2:
        raise ValueError(f"a document split needs at least 2 documents, got {len(documents)}; use train_val_split")
    budget = val_fraction * sum(len(doc) for doc in documents)
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    held, used = set(), 0
    for i in order:
        if used + len(documents[i]) <= budget:
            held.add(i)
            used += len(documents[i])
    if not held:
        raise ValueError(f"no document fits in {val_fraction:.0%} of the corpus; raise val_fraction")
    train = [doc for i, doc in enumerate(documents) if i not in held]
    return train, [documents[i] for i in sorted(held)]


class NextTokenDataset(Dataset):
    """Sliding windows over a token stream: input ids[s : s+T], target ids[s+1 : s+T+1]."""

    def __init__(self, ids: torch.Tensor, context_length: int, stride: int | None = None) -> None:
        stride = context_length if stride is None else stride
        if context_length <= 0 or stride <= 0:
            raise ValueError(f"context_length and stride must be positive, got {context_length}, {stride}")
        if len(ids) < context_length + 1:
            raise ValueError(
                f"{len(ids)} tokens cannot fill one window of context_length {context_length} "
                "plus its shifted target; use more text or a shorter context"
            )
        self.ids = torch.as_tensor(ids, dtype=torch.long)
        self.context_length = context_length
        self.stride = stride
        self.n_windows = (len(self.ids) - context_length - 1) // stride + 1

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.n_windows <= i < self.n_windows:
            raise IndexError(f"window {i} out of range for {self.n_windows} windows")
        start = (i % self.n_windows) * self.stride
        window = self.ids[start : start + self.context_length + 1]
        return window[:-1], window[1:]


def make_dataloader(
    ids: torch.Tensor,
    batch_size: int,
    context_length: int,
    stride: int | None = None,
    shuffle: bool = True,
    drop_last: bool = True,
    seed: int = 0,
) -> DataLoader:
    """Batches of (inputs, targets), each (batch_size, context_length); shuffling is seeded."""
    dataset = NextTokenDataset(ids, context_length, stride)
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, generator=generator)


def load_token_ids(name: str = DEFAULT_CORPUS) -> torch.Tensor:
    """A corpus tokenized with GPT-2's BPE, as one long tensor of token ids."""
    from .tokenizer import get_tokenizer

    return torch.tensor(get_tokenizer().encode_ordinary(load_corpus(name)), dtype=torch.long)


def keep_frequent_tokens(ids: torch.Tensor, reference: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A reduced vocabulary: token ids renumbered by their frequency in `reference` (the most frequent becomes 0, ties
    by id), every token outside the top `vocab_size - 1` sharing the last id. Short CPU runs keep GPT-2's tokenizer
    with a 4,096-row embedding instead of 50,257."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2 (one kept token and the shared id), got {vocab_size}")
    counts = torch.bincount(reference, minlength=int(max(reference.max(), ids.max())) + 1)
    rank = torch.empty_like(counts)
    rank[counts.argsort(descending=True, stable=True)] = torch.arange(len(counts))
    return rank[ids].clamp(max=vocab_size - 1)
