"""Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention does the same at token granularity):
requests that start with the same tokens, such as a shared system prompt, share the KV blocks of that prefix
instead of each computing and storing it.

Keys and values at position p depend only on tokens 0..p (attention is causal), so a full block is named by
its own tokens and every token before it: a chain hash, digest(block) = sha256(digest(previous block) + its
tokens). `PrefixIndex` maps digests to the blocks that hold them. A new request walks its prompt block by
block; the blocks it finds are shared (reference counts in `helpers.inference.paged_kv.BlockAllocator`), and
where it diverges *inside* a cached block it shares that block's first tokens too, copying the block before
its first write (copy-on-write). Only full blocks are indexed: a block still being filled belongs to one
sequence.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = b""  # the digest "before" the first block


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The chain hash of a block: sha256 of the previous block's digest and this block's token ids."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


@dataclass(frozen=True)
class IndexedBlock:
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class PrefixMatch:
    """What a prompt finds in the index: `blocks` hold its first `tokens` tokens (the last block possibly only
    partly: the prompt diverges inside it)."""

    blocks: tuple[int, ...] = ()
    tokens: int = 0


class PrefixIndex:
    """Full KV blocks by chain hash, and by their predecessor (to find the longest match inside a block)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._by_digest: dict[bytes, int] = {}
        self._entries: dict[int, IndexedBlock] = {}
        self._children: dict[bytes, set[int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block: int) -> bool:
        return block in self._entries

    def digest_of(self, block: int) -> bytes:
        return self._entries[block].digest

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens`: whole blocks by digest, then the cached block (after the last
        whole one) that shares the most leading tokens with the rest, if any."""
        bs, parent, blocks = self.block_size, ROOT, []
        while len(blocks) * bs + bs <= len(tokens):
            start = len(blocks) * bs
            digest = block_digest(parent, tokens[start : start + bs])
            if digest not in self._by_digest:
                break
            blocks.append(self._by_digest[digest])
            parent = digest
        matched = len(blocks) * bs
        rest = tokens[matched : matched + bs]
        best, best_len = None, 0
        for block in self._children.get(parent, ()):
            cached = self._entries[block].tokens
            common = next((i for i, (a, b) in enumerate(zip(cached, rest, strict=False)) if a != b),
                          min(len(cached), len(rest)))
            if common > best_len:
                best, best_len = block, common
        if best is not None:
            blocks.append(best)
            matched += best_len
        return PrefixMatch(tuple(blocks), matched)

    def add(self, block: int, parent: bytes, tokens: Sequence[int]) -> bytes:
        """Index a full block that follows the block with digest `parent`; returns its digest. If the same
        prefix is already indexed (two requests computed it at once), the first block stays the cached one."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are indexed: got {len(tokens)} tokens, blocks hold {self.block_size}")
        digest = block_digest(parent, tokens)
        if digest not in self._by_digest and block not in self._entries:
            self._by_digest[digest] = block
            self._entries[block] = IndexedBlock(digest, parent, tuple(tokens))
            self._children.setdefault(parent, set()).add(block)
        return digest

    def forget(self, block: int) -> None:
        """Drop a block from the index (it is being reused for other tokens); a no-op if it is not indexed."""
        entry = self._entries.pop(block, None)
        if entry is None:
            return
        del self._by_digest[entry.digest]
        siblings = self._children[entry.parent]
        siblings.discard(block)
        if not siblings:
            del self._children[entry.parent]
