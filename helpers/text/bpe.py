"""Byte-level byte-pair encoding (BPE), trained from scratch: the algorithm behind GPT-2's tokenizer.

Text is UTF-8 bytes (256 base tokens, so any string can be encoded); a pre-tokenization regex (GPT-2's by default)
first splits it into chunks (words with their leading space, numbers, punctuation runs, whitespace), and merges
never cross a chunk boundary: " the" is one chunk, and a different token from "the". Training counts adjacent
token pairs over the chunks and repeatedly merges the most frequent pair into a new token; encoding replays the
merges in the order they were learned. GPT-2's tokenizer is this algorithm with
50,000 merges learned from WebText (tiktoken runs it in Rust); `ch02_text/01_tokenization.ipynb` compares them.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import regex

from .tokenizer import GPT2_PATTERN, gpt2_file

BYTE_TOKENS = 256

Pair = tuple[int, int]


def pair_counts(chunks: dict[tuple[int, ...], int]) -> Counter[Pair]:
    """How often each adjacent pair of tokens occurs, each chunk weighted by how often it occurs in the text."""
    counts: Counter[Pair] = Counter()
    for chunk, n in chunks.items():
        for pair in zip(chunk, chunk[1:], strict=False):
            counts[pair] += n
    return counts


def merge(tokens: tuple[int, ...] | list[int], pair: Pair, new: int) -> tuple[int, ...]:
    """Replace every occurrence of `pair`, left to right and without overlaps, by the token `new`."""
    out, i = [], 0
    while i < len(tokens):
        if i + 1 < len(tokens) and (tokens[i], tokens[i + 1]) == pair:
            out.append(new)
            i += 2
        else:
            out.append(tokens[i])
            i += 1
    return tuple(out)


@dataclass
class BPETokenizer:
    """A trained byte-level BPE: `merges[i]` is the pair that became token 256 + i."""

    merges: list[Pair]
    pattern: str = GPT2_PATTERN
    special_tokens: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ranks = {pair: BYTE_TOKENS + i for i, pair in enumerate(self.merges)}
        self.token_bytes = [bytes([b]) for b in range(BYTE_TOKENS)]
        for a, b in self.merges:
            self.token_bytes.append(self.token_bytes[a] + self.token_bytes[b])
        for name, token in self.special_tokens.items():
            if token < len(self.token_bytes):
                raise ValueError(f"special token {name!r} has id {token}, which a merge already uses; "
                                 f"give it an id of {len(self.token_bytes)} or more")
        self._split = regex.compile(self.pattern)
        self._cache: dict[str, list[int]] = {}

    def clear_cache(self) -> None:
        """Forget the chunks encoded so far (each distinct chunk is merged once, then looked up), e.g. to time
        encoding from scratch."""
        self._cache.clear()

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes) + len(self.special_tokens)

    def encode_chunk(self, chunk: str) -> list[int]:
        """One pre-tokenized chunk: its bytes, then the learned merges, the earliest-learned applicable one first."""
        if chunk in self._cache:
            return self._cache[chunk]
        tokens = tuple(chunk.encode("utf-8"))
        while len(tokens) > 1:
            pair = min(zip(tokens, tokens[1:], strict=False), key=lambda p: self.ranks.get(p, float("inf")))
            if pair not in self.ranks:
                break
            tokens = merge(tokens, pair, self.ranks[pair])
        self._cache[chunk] = list(tokens)
        return self._cache[chunk]

    def encode(self, text: str, allowed_special: Iterable[str] = ()) -> list[int]:
        """Token ids of `text`. A special token's text is encoded as its id only when it is in `allowed_special`;
        otherwise it is refused (text from users must not be able to end a document)."""
        allowed = set(allowed_special)
        unknown = allowed - set(self.special_tokens)
        if unknown:
            raise ValueError(f"unknown special tokens {sorted(unknown)}; this tokenizer has "
                             f"{sorted(self.special_tokens) or 'none'}")
        for name in self.special_tokens:
            if name not in allowed and name in text:
                raise ValueError(f"the text contains the special token {name!r}; pass allowed_special={{{name!r}}} "
                                 "to encode it as one token")
        ids: list[int] = []
        for i, part in enumerate(regex.split(f"({'|'.join(map(regex.escape, allowed))})", text) if allowed
                                 else [text]):
            if i % 2:  # the separators the split kept: allowed special tokens
                ids.append(self.special_tokens[part])
            else:
                for chunk in self._split.findall(part):
                    ids.extend(self.encode_chunk(chunk))
        return ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of `text` with special tokens' names encoded as plain text, as tiktoken's `encode_ordinary`
        (for a client's text, which must not be able to end a document)."""
        return [token for chunk in self._split.findall(text) for token in self.encode_chunk(chunk)]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids (invalid UTF-8, possible when ids are cut mid-character, shows as U+FFFD)."""
        names = {token: name.encode("utf-8") for name, token in self.special_tokens.items()}
        return b"".join(names[t] if t in names else self.token_bytes[t] for t in ids).decode("utf-8", "replace")


def train_bpe(text: str, vocab_size: int, pattern: str = GPT2_PATTERN,
              special_tokens: Iterable[str] = ()) -> BPETokenizer:
    """Learn `vocab_size - 256 - len(special_tokens)` merges from `text`.

    Each round merges the most frequent adjacent pair (ties: the smallest pair of ids, so training is
    deterministic); training stops early when no pair occurs twice. Special tokens get the ids after the merges.
    The merges are those of recounting every pair each round (`pair_counts`, the loop chapter 2 writes), but the
    counts are kept up to date instead: a merge recounts only the chunks that contain its pair, and a heap of
    (count, pair) entries, stale ones skipped, yields the most frequent pair, so a round costs what it changes.
    """
    specials = list(dict.fromkeys(special_tokens))
    n_merges = vocab_size - BYTE_TOKENS - len(specials)
    if n_merges < 0:
        raise ValueError(f"vocab_size={vocab_size} is below the {BYTE_TOKENS} byte tokens plus {len(specials)} "
                         f"special token(s); pass at least {BYTE_TOKENS + len(specials)}")
    words = Counter(regex.findall(pattern, text))
    chunks = [tuple(word.encode("utf-8")) for word in words]
    weights = list(words.values())
    counts = pair_counts(dict(zip(chunks, weights, strict=True)))
    holders: defaultdict[Pair, set[int]] = defaultdict(set)  # pair -> indices of the chunks it occurs in
    for i, chunk in enumerate(chunks):
        for pair in zip(chunk, chunk[1:], strict=False):
            holders[pair].add(i)
    heap = [(-n, pair) for pair, n in counts.items()]
    heapq.heapify(heap)
    merges: list[Pair] = []
    while heap and len(merges) < n_merges:
        negative, best = heapq.heappop(heap)
        if counts.get(best) != -negative:
            continue  # stale: the pair's count changed after this entry was pushed
        if -negative < 2:
            break
        new = BYTE_TOKENS + len(merges)
        merges.append(best)
        changed: set[Pair] = set()
        for i in holders.pop(best):
            before = Counter(zip(chunks[i], chunks[i][1:], strict=False))
            chunks[i] = merge(chunks[i], best, new)
            after = Counter(zip(chunks[i], chunks[i][1:], strict=False))
            for pair in before.keys() | after.keys():
                if after[pair] != before[pair]:
                    counts[pair] += (after[pair] - before[pair]) * weights[i]
                    changed.add(pair)
            for pair in after.keys() - before.keys():
                holders[pair].add(i)
        for pair in changed:
            if counts[pair] > 0:
                heapq.heappush(heap, (-counts[pair], pair))
            else:
                del counts[pair]
                holders.pop(pair, None)
    first_special = BYTE_TOKENS + len(merges)
    return BPETokenizer(merges, pattern, {name: first_special + i for i, name in enumerate(specials)})


def gpt2_byte_characters() -> dict[int, str]:
    """GPT-2's files write each byte as a printable character: printable Latin-1 bytes as themselves, the others
    (control bytes, space) as the characters from U+0100 on, in byte order ("Ġ" is the space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(BYTE_TOKENS) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(BYTE_TOKENS + i) for i, b in enumerate(others)}


def gpt2_merges() -> list[Pair]:
    """GPT-2's 50,000 merges from its `vocab.bpe`, in the order they were learned, as pairs of our token ids (byte
    tokens are the byte values; merge i makes token 256 + i, as in GPT-2, whose byte tokens are ordered
    differently)."""
    byte_of = {c: b for b, c in gpt2_byte_characters().items()}
    ids = {bytes([b]): b for b in range(BYTE_TOKENS)}
    merges: list[Pair] = []
    with open(gpt2_file("vocab.bpe"), encoding="utf-8") as f:
        lines = f.read().split("\n")[1:]  # the first line is a version header
    for line in filter(None, lines):
        a, b = (bytes(byte_of[c] for c in part) for part in line.split(" "))
        merges.append((ids[a], ids[b]))
        ids[a + b] = BYTE_TOKENS + len(merges) - 1
    return merges
