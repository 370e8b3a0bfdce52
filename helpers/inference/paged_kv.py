"""PagedAttention's memory layer (Kwon et al. 2023, the paper behind vLLM): the KV cache lives in fixed-size
blocks, each sequence has a block table (its blocks in order), and a free list hands blocks out and takes them
back. A sequence holds ceil(tokens / block_size) blocks, so at most one partly filled block per sequence is
wasted, and a finished sequence's blocks are reused at once by any other sequence.

Attention reads keys and values through the block table; the attention math itself is unchanged (scores are
scaled by 1/sqrt(head_dim), never by the block size). `gather` copies a sequence's blocks into one tensor, the
readable version of what a fused paged-attention kernel does in place; the model's attention backend reads them
the same way unless it brings a paged kernel of its own (it is handed the flat slots, `KVRead.slots`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Hashable, Sequence
from typing import NamedTuple

import torch

from ..model.attention import IMPLEMENTATIONS
from .cached_attention import KVRead, KVStorage
from .kv_format import KVFormat, as_kv_format
from .prefix_cache import ROOT, PrefixIndex, PrefixMatch


class OutOfBlocks(RuntimeError):
    """No free block: a scheduler makes the request wait, or preempts another one."""


class BlockAllocator:
    """Block ids 0..num_blocks-1 with reference counts: a block is free at count 0, and with prefix caching
    several sequences hold (share) one block. Allocation is all-or-nothing, and freeing a block nobody holds is
    an error, so `num_free + num_used == num_blocks` always holds.

    A freed block whose contents are worth keeping (a cached prefix, `retain` in `free`) is free but
    *evictable*: allocation takes blocks that hold nothing first (the most recently freed first), then
    evictable ones, least recently freed first, and `share` can take an evictable block back as it is.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self._evictable: dict[int, None] = {}  # free blocks that keep their contents, least recently freed first
        self._refs: dict[int, int] = {}  # reference count of each held block

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def allocate(self, n: int) -> list[int]:
        """`n` free block ids, or OutOfBlocks (allocating none) when fewer than `n` are free."""
        if n > self.num_free:
            raise OutOfBlocks(f"{n} blocks requested but only {self.num_free} of {self.num_blocks} are free")
        blocks = [self._free.pop() if self._free else self._pop_evictable() for _ in range(n)]
        self._refs.update(dict.fromkeys(blocks, 1))
        return blocks

    def _pop_evictable(self) -> int:
        block = next(iter(self._evictable))
        del self._evictable[block]
        return block

    def share(self, block: int) -> None:
        """One more holder of `block`: a held block, or an evictable one taken back with its contents."""
        if block in self._refs:
            self._refs[block] += 1
        elif block in self._evictable:
            del self._evictable[block]
            self._refs[block] = 1
        else:
            raise ValueError(f"cannot share block {block}: it is free and holds nothing")

    def free(self, blocks: list[int], retain: Container[int] = ()) -> None:
        """Drop one reference to each block; all are checked first, so a bad list frees nothing. A block nobody
        holds any more goes on the free list, or, if it is in `retain`, becomes evictable."""
        bad = [b for b in blocks if b not in self._refs]
        if bad or len(set(blocks)) != len(blocks):
            raise ValueError(f"cannot free blocks {blocks}: {bad or 'duplicates'} not allocated (a double free?)")
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                if block in retain:
                    self._evictable[block] = None
                else:
                    self._free.append(block)


class PagedKVCache:
    """Keys and values of every layer in `num_blocks` blocks of `block_size` token slots each.

    Each layer's keys are stored as (num_blocks * block_size, n_heads, head_dim), and its values the same: token
    `p` of a sequence lives in flat slot `block * block_size + p % block_size`, `block = block_table[p //
    block_size]`.

    With `prefix_caching`, full blocks are indexed by the tokens up to their end (`helpers.inference.prefix_cache`)
    as sequences compute them (`commit`), a new sequence starts from the blocks of its longest cached prefix
    (`match_prefix`, `attach`), and a released block keeps its contents (evictable) until it is allocated again.
    A sequence only ever writes into blocks it holds alone and that are not indexed.

    With `kv_format="int8"` keys and values are stored as int8 with a float32 scale per token slot and head
    (`helpers.inference.kv_format`), and read back in `dtype`.
    """

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 prefix_caching: bool = False, kv_format: str | KVFormat = "auto") -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.kv_format = as_kv_format(kv_format)
        self.storage = KVStorage(n_layers, (num_blocks * block_size, n_heads, head_dim), dtype, device, self.kv_format)
        self.dtype, self.device = dtype, self.storage.device
        self.block_tables: dict[Hashable, list[int]] = {}
        self._tables: dict[Hashable, torch.Tensor] = {}  # the same tables as tensors, for indexing
        self.prefix_index = PrefixIndex(block_size) if prefix_caching else None
        self._indexed: dict[Hashable, tuple[int, bytes]] = {}  # per sequence: leading blocks indexed, last digest

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def allocated_slots(self) -> int:
        """Token slots in blocks that some sequence holds (used or not); a shared block counts once."""
        return self.allocator.num_used * self.block_size

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of keys and values (and their scales) one token takes across all layers."""
        return self.storage.nbytes // (self.num_blocks * self.block_size)

    def blocks_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block_size)

    def blocks_missing(self, seq_id: Hashable, n_tokens: int) -> int:
        """Blocks `seq_id` still needs to hold `n_tokens` tokens."""
        return max(0, self.blocks_for(n_tokens) - len(self.block_tables.get(seq_id, ())))

    def can_hold(self, seq_id: Hashable, n_tokens: int) -> bool:
        return self.blocks_missing(seq_id, n_tokens) <= self.allocator.num_free

    def reserve(self, seq_id: Hashable, n_tokens: int) -> None:
        """Grow `seq_id`'s block table (creating it if new) to hold `n_tokens` tokens; OutOfBlocks if it can't."""
        new = self.allocator.allocate(self.blocks_missing(seq_id, n_tokens))
        if self.prefix_index is not None:
            for block in new:  # an evicted block's old contents are about to be overwritten
                self.prefix_index.forget(block)
        table = self.block_tables.setdefault(seq_id, [])
        if new or seq_id not in self._tables:
            table.extend(new)
            self._tables[seq_id] = torch.tensor(table, dtype=torch.long, device=self.device)

    def release(self, seq_id: Hashable) -> None:
        """Drop `seq_id`'s hold on its blocks: those nobody else holds are free for other sequences at once
        (indexed ones keep their contents until they are allocated again)."""
        self.allocator.free(self.block_tables.pop(seq_id), retain=self.prefix_index or ())
        del self._tables[seq_id]
        self._indexed.pop(seq_id, None)

    # ---- prefix caching ----

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The cached blocks a new sequence of these tokens can start from (none without prefix caching). At
        least the last token is left to compute: its logits give the first new token."""
        if self.prefix_index is None:
            return PrefixMatch()
        match = self.prefix_index.lookup(tokens)
        return PrefixMatch(match.blocks, min(match.tokens, len(tokens) - 1))

    def _copy_on_write(self, match: PrefixMatch) -> bool:
        """Whether the first write of a sequence starting from `match` falls inside one of the matched blocks."""
        return bool(match.blocks) and match.tokens < len(match.blocks) * self.block_size

    def blocks_to_attach(self, match: PrefixMatch, n_tokens: int) -> int:
        """Free blocks that `attach(seq, match, n_tokens)` takes: matched ones that were evictable, a copy of a
        block the sequence diverges in, and new blocks up to `n_tokens`."""
        taken_back = sum(self.allocator.is_evictable(b) for b in match.blocks)
        grow = max(0, self.blocks_for(n_tokens) - len(match.blocks))
        return taken_back + self._copy_on_write(match) + grow

    def attach(self, seq_id: Hashable, match: PrefixMatch, n_tokens: int) -> None:
        """Start a new sequence from the cached blocks of `match`, then reserve up to `n_tokens` tokens. The block
        its first new token goes into, if a matched one, is copied first (copy-on-write): others hold it."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks; attach only a new sequence")
        if self.blocks_to_attach(match, n_tokens) > self.allocator.num_free:
            raise OutOfBlocks(f"{self.blocks_to_attach(match, n_tokens)} blocks needed for sequence {seq_id!r} but "
                              f"only {self.allocator.num_free} of {self.num_blocks} are free")
        table = list(match.blocks)
        for block in table:
            self.allocator.share(block)
        if self._copy_on_write(match):
            i = match.tokens // self.block_size
            (copy,) = self.allocator.allocate(1)
            self.prefix_index.forget(copy)
            size = self.block_size
            self.storage.copy(slice(table[i] * size, (table[i] + 1) * size), slice(copy * size, (copy + 1) * size))
            self.allocator.free([table[i]], retain=self.prefix_index)
            table[i] = copy
        self.block_tables[seq_id] = table
        full = match.tokens // self.block_size  # leading blocks that are shared and stay indexed
        self._indexed[seq_id] = (full, self.prefix_index.digest_of(table[full - 1]) if full else ROOT)
        self.reserve(seq_id, n_tokens)

    def commit(self, seq_id: Hashable, tokens: Sequence[int], num_computed: int) -> None:
        """With prefix caching, index the blocks of `seq_id` that its first `num_computed` tokens (of `tokens`,
        its whole sequence so far) fill completely; they are never written again."""
        if self.prefix_index is None:
            return
        count, parent = self._indexed.get(seq_id, (0, ROOT))
        table, bs = self.block_tables[seq_id], self.block_size
        while (count + 1) * bs <= num_computed:
            parent = self.prefix_index.add(table[count], parent, tokens[count * bs : (count + 1) * bs])
            count += 1
        self._indexed[seq_id] = (count, parent)

    def slots(self, seq_id: Hashable, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (block * block_size + offset) of positions start..end-1 of `seq_id`."""
        if end > len(self.block_tables[seq_id]) * self.block_size:
            raise ValueError(f"positions up to {end} of sequence {seq_id!r} are beyond its reserved blocks")
        pos = torch.arange(start, end, device=self.device)
        return self._tables[seq_id][pos // self.block_size] * self.block_size + pos % self.block_size

    def padded_slots(self, seq_ids: list[Hashable], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of positions 0..length-1 of several sequences, padded to the longest: (slots, valid), both of
        shape (sequences, max length); padding points at slot 0 and is False in `valid`."""
        device, width = self.device, self.blocks_for(max(lengths))
        pos = torch.arange(max(lengths), device=device)
        valid = pos < torch.tensor(lengths, device=device)[:, None]
        rows = [self.block_tables[s][: self.blocks_for(n)] for s, n in zip(seq_ids, lengths, strict=True)]
        tables = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
        slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size
        return slots.masked_fill(~valid, 0), valid

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape (tokens, n_heads, head_dim) into the given flat slots of one layer."""
        self.storage.write(layer, slots, k, v)

    def gather(self, layer: int, seq_id: Hashable, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of `seq_id` at one layer, read through its block table, as
        (n_heads, length, head_dim) tensors in the cache's dtype."""
        k, v = self.storage.at(layer, self.slots(seq_id, 0, length)[None]).read(self.dtype)
        return k[0], v[0]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, backend: str = "sdpa") -> torch.Tensor:
    """One sequence's new queries q (heads, n, head_dim), positions start..start+n-1, over its keys and values
    (heads, start+n, head_dim) gathered from its blocks, with the attention `backend` (a name of
    `helpers.model.attention.IMPLEMENTATIONS`) as over any cache.

    The same softmax(q k^T / sqrt(head_dim)) v as any attention: where k and v came from does not enter the math.
    """
    return IMPLEMENTATIONS[backend].attend(q.unsqueeze(0), KVRead(k.unsqueeze(0), v.unsqueeze(0), start=start))[0]


class BatchRow(NamedTuple):
    """One sequence's chunk in a PagedBatch: `length` tokens from position `start`."""

    seq_id: Hashable
    start: int
    length: int


class PrefillChunk(NamedTuple):
    """A chunk longer than one token, as attention reads it: where its tokens sit in the batch's row (`offset`),
    its first position, its length, and the cache slots of its sequence up to its end."""

    offset: int
    start: int
    length: int
    slots: torch.Tensor


class PagedBatch:
    """One iteration of the serving engine as the model sees it: a ragged batch of chunks, one per sequence (a whole
    or partial prompt, or the newest token while decoding), concatenated into a single row of tokens.

    `rows` lists each chunk's BatchRow, one-token chunks first. The model runs its Linear
    layers, LayerNorms and MLP on all tokens at once; its attention layers call `update`, which stores each chunk's
    keys and values in the sequence's blocks and says what each group of queries reads; the model's backend
    attends: the one-token rows in one batched call over their keys padded to the longest, longer chunks one by one.
    """

    def __init__(self, cache: PagedKVCache, rows: list[BatchRow]) -> None:
        lengths = [n for _, _, n in rows]
        if lengths != sorted(lengths, key=lambda n: n > 1):
            raise ValueError("put the one-token rows of a PagedBatch first (their attention is one batched call)")
        device = cache.device
        self.cache = cache
        self.tokens = sum(n for _, _, n in rows)
        self.pos = torch.cat([torch.arange(start, start + n, device=device) for _, start, n in rows])
        self.slots = torch.cat([cache.slots(seq_id, start, start + n) for seq_id, start, n in rows])
        ends = torch.tensor([n for _, _, n in rows], device=device).cumsum(0)
        self.last = ends - 1  # each chunk's last token: where its next-token logits come from
        self.decoding = sum(n == 1 for _, _, n in rows)
        if self.decoding:
            decode = rows[: self.decoding]
            self.decode_slots, self.decode_valid = cache.padded_slots([s for s, _, _ in decode],
                                                                      [start + 1 for _, start, _ in decode])
        self.chunks = [PrefillChunk(int(end - n), start, n, cache.slots(seq_id, 0, start + n))
                       for (seq_id, start, n), end in zip(rows, ends.tolist(), strict=True) if n > 1]

    def positions(self, seq: int, device: torch.device) -> torch.Tensor:
        if seq != self.tokens:
            raise ValueError(f"this PagedBatch holds {self.tokens} tokens, the input has {seq}")
        return self.pos

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[KVRead]:
        """k, v: (1, kv_heads, tokens, head_dim), the tokens of every chunk in a row, stored in their slots. Each
        group of queries reads its sequences' slots: the one-token rows together, padded to the longest, longer
        chunks one by one."""
        self.cache.write(layer, self.slots, k[0].transpose(0, 1), v[0].transpose(0, 1))
        storage = self.cache.storage
        reads = []
        if self.decoding:
            reads.append(storage.at(layer, self.decode_slots, allowed=self.decode_valid[:, None, None, :],
                                    queries=slice(0, self.decoding), one_token_each=True))
        reads += [storage.at(layer, chunk.slots[None], start=chunk.start,
                             queries=slice(chunk.offset, chunk.offset + chunk.length)) for chunk in self.chunks]
        return reads

    def advance(self, seq: int) -> None:
        """The engine tracks each sequence's progress itself (`num_computed`)."""
