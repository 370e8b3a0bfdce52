"""Prefix caching: the index against a brute-force longest common prefix, reference counts and eviction in the
allocator, copy-on-write that leaves the shared block intact, and the engine's tokens against `GPT.generate`
greedy per request in float64, with the prefill it saved counted exactly."""

import json
import os
import random

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.paged_kv import BlockAllocator, OutOfBlocks, PagedKVCache
from helpers.inference.prefix_cache import ROOT, PrefixIndex, block_digest
from helpers.inference.serving import Engine, Request, serve
from helpers.measure.serving_bench import reference_tokens, shared_prefix_workload
from helpers.notebooks import ROOT as REPO_ROOT

CONFIG = GPTConfig(vocab_size=61, context_length=64, d_model=32, n_heads=2, n_layers=2, dropout=0.0)


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    return GPT(CONFIG).double().eval()


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- the index ----


def test_block_digest_names_a_block_by_every_token_up_to_its_end():
    first = block_digest(ROOT, [1, 2, 3])
    assert block_digest(first, [4, 5, 6]) == block_digest(first, [4, 5, 6])
    assert block_digest(first, [4, 5, 6]) != block_digest(block_digest(ROOT, [1, 2, 9]), [4, 5, 6])
    assert block_digest(ROOT, [1, 2]) != block_digest(ROOT, [1, 2, 0])  # not a padded comparison


def test_lookup_finds_the_longest_cached_prefix_as_a_brute_force_search_does():
    rng = random.Random(0)
    bs, index, cached = 4, PrefixIndex(4), []
    for seq in range(30):  # a tiny vocabulary, so prefixes are often shared, and often diverge inside a block
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
        parent = ROOT
        for i in range(len(tokens) // bs):
            parent = index.add(100 * seq + i, parent, tokens[i * bs : (i + 1) * bs])
        cached.append(tokens[: len(tokens) // bs * bs])
    for _ in range(200):
        query = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        match = index.lookup(query)
        assert match.tokens == max(common_prefix(query, c) for c in cached)
        assert len(match.blocks) == -(-match.tokens // bs)  # ceil: the last block may match only partly


def test_forget_removes_a_block_and_lookups_stop_before_it():
    index = PrefixIndex(2)
    d0 = index.add(7, ROOT, [1, 2])
    index.add(8, d0, [3, 4])
    assert index.lookup([1, 2, 3, 4, 5]).blocks == (7, 8)
    index.forget(7)
    assert 7 not in index and index.lookup([1, 2, 3, 4]).tokens == 0
    index.forget(7)  # forgetting twice is a no-op
    with pytest.raises(ValueError, match="only full blocks"):
        index.add(9, ROOT, [1])


# ---- reference counts and eviction ----


def test_shared_blocks_are_freed_when_the_last_holder_lets_go():
    alloc = BlockAllocator(4)
    (a,) = alloc.allocate(1)
    alloc.share(a)
    assert alloc.refcount(a) == 2 and alloc.num_free == 3
    alloc.free([a])
    assert alloc.refcount(a) == 1 and alloc.num_free == 3
    alloc.free([a])
    assert alloc.refcount(a) == 0 and alloc.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        alloc.free([a])
    with pytest.raises(ValueError, match="free and holds nothing"):
        alloc.share(a)


def test_evictable_blocks_are_reused_last_and_least_recently_freed_first():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(4)
    alloc.free([blocks[2]], retain={blocks[2]})
    alloc.free([blocks[0]], retain={blocks[0]})
    alloc.free([blocks[1]])  # holds nothing worth keeping
    assert alloc.num_free == 3 and alloc.is_evictable(blocks[2])
    assert alloc.allocate(1) == [blocks[1]]  # the empty block first
    alloc.share(blocks[0])  # an evictable block taken back as it is
    assert not alloc.is_evictable(blocks[0]) and alloc.refcount(blocks[0]) == 1
    assert alloc.allocate(1) == [blocks[2]]
    with pytest.raises(OutOfBlocks):
        alloc.allocate(1)


def test_copy_on_write_leaves_the_shared_block_as_it_was():
    cache = PagedKVCache(1, 1, 2, num_blocks=6, block_size=4, dtype=torch.float64, prefix_caching=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    cache.reserve("a", len(a))
    cache.write(0, cache.slots("a", 0, 8), torch.arange(16.0).view(8, 1, 2).double(), torch.zeros(8, 1, 2).double())
    cache.commit("a", a, 8)
    before = cache.gather(0, "a", 8)[0].clone()
    b = [1, 2, 3, 4, 5, 6, 0]  # shares a's first block whole and 2 tokens of its second
    match = cache.match_prefix(b)
    assert match.tokens == 6 and match.blocks == tuple(cache.block_tables["a"])
    cache.attach("b", match, len(b))
    shared, copied = cache.block_tables["b"]
    assert shared == cache.block_tables["a"][0] and copied not in cache.block_tables["a"]
    assert cache.allocator.refcount(shared) == 2 and cache.allocator.refcount(cache.block_tables["a"][1]) == 1
    assert torch.equal(cache.gather(0, "b", 6)[0], before[:, :6])  # the copy holds the shared tokens
    cache.write(0, cache.slots("b", 6, 7), torch.full((1, 1, 2), -1.0).double(), torch.zeros(1, 1, 2).double())
    assert torch.equal(cache.gather(0, "a", 8)[0], before)  # a's blocks are untouched
    cache.release("a")
    cache.release("b")
    assert cache.allocator.num_used == 0 and cache.allocator.num_free == 6


def test_a_prompt_found_whole_still_computes_its_last_token_in_a_copy():
    cache = PagedKVCache(1, 1, 2, num_blocks=4, block_size=4, prefix_caching=True)
    prompt = [5, 6, 7, 8]
    cache.reserve("a", 4)
    cache.commit("a", prompt, 4)
    match = cache.match_prefix(prompt)
    assert match.tokens == 3  # the last token's logits are needed for the first new token
    cache.attach("b", match, 5)
    assert cache.block_tables["b"][0] != cache.block_tables["a"][0]
    with pytest.raises(OutOfBlocks, match="needed"):
        cache.attach("c", cache.match_prefix(prompt), 16)
    assert "c" not in cache.block_tables and cache.allocator.num_used == 3


def test_reused_blocks_leave_the_index():
    cache = PagedKVCache(1, 1, 2, num_blocks=2, block_size=2, prefix_caching=True)
    cache.reserve("a", 4)
    cache.commit("a", [1, 2, 3, 4], 4)
    cache.release("a")
    assert cache.allocator.num_free == 2 and cache.match_prefix([1, 2, 3, 4, 9]).tokens == 4
    cache.reserve("b", 2)  # a sequence's blocks are freed last to first: its tail is evicted before its head
    assert cache.match_prefix([1, 2, 3, 4, 9]).tokens == 2
    cache.reserve("b", 4)
    assert cache.match_prefix([1, 2, 3, 4, 9]).tokens == 0


# ---- the engine ----


def shared_prefix_requests(prefix_len, n, seed=0, max_out=6):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, CONFIG.vocab_size, (prefix_len,), generator=g).tolist()
    out = []
    for i in range(n):
        own = torch.randint(0, CONFIG.vocab_size, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
        out.append(Request(f"r{i}", tuple(prefix + own.tolist()), int(torch.randint(1, max_out + 1, (1,),
                                                                                       generator=g))))
    return out


@pytest.mark.parametrize("block_size", [4, 5])  # the 19-token prefix ends inside a block of either size
def test_engine_with_prefix_caching_gives_each_request_its_own_greedy_tokens(model64, block_size):
    requests = shared_prefix_requests(19, 8)
    requests.append(Request("again", requests[0].prompt, 5))  # a prompt found whole in the cache
    expected = [reference_tokens(model64, r) for r in requests]
    run = serve(model64, requests, max_batch=3, block_size=block_size, prefix_caching=True)
    assert [c.tokens for c in run.completions] == expected
    assert run.cached_tokens > 0 and run.prefix_hit_rate > 0
    assert run.cached_tokens + run.prefill_tokens == sum(len(r.prompt) for r in requests)
    plain = serve(model64, requests, max_batch=3, block_size=block_size)
    assert plain.cached_tokens == 0 and plain.prefill_tokens == sum(len(r.prompt) for r in requests)


def test_one_request_at_a_time_finds_the_whole_shared_prefix(model64):
    requests = shared_prefix_requests(13, 4)
    engine = Engine(model64, max_batch=1, block_size=4, prefix_caching=True)
    for r in requests:
        engine.submit(r)
    run = engine.run()
    # the first computes everything; each later one finds the 13 shared tokens (and, by chance, any more)
    expected = [0] + [common_prefix(r.prompt, max(requests[:i], key=lambda p: common_prefix(r.prompt, p.prompt))
                                    .prompt) for i, r in enumerate(requests) if i]
    assert [c.cached_tokens for c in run.completions] == [min(e, len(r.prompt) - 1)
                                                           for e, r in zip(expected, requests, strict=True)]
    assert all(e >= 13 for e in expected[1:])
    assert engine.cache.allocator.num_used == 0  # every block freed when its last user finished


def test_prefix_caching_under_preemption_keeps_the_tokens(model64):
    requests = shared_prefix_requests(10, 6, seed=3, max_out=12)
    expected = [reference_tokens(model64, r) for r in requests]
    run = serve(model64, requests, max_batch=6, block_size=2, num_blocks=14, prefix_caching=True)
    assert run.preemptions > 0
    assert [c.tokens for c in run.completions] == expected


def test_prefix_caching_needs_continuous_scheduling(model64):
    with pytest.raises(ValueError, match="scheduling='continuous'"):
        Engine(model64, max_batch=2, scheduling="static", prefix_caching=True)
    with pytest.raises(ValueError, match="True or False"):
        Engine(model64, max_batch=2, prefix_caching="yes")


# ---- the workload and bench-serve ----


def test_shared_prefix_workload_shares_exactly_its_prefix_and_fits_the_context():
    token_ids = torch.arange(5000) % 50000
    requests = shared_prefix_workload(50, 512, 256, seed=2, token_ids=token_ids)
    assert requests == shared_prefix_workload(50, 512, 256, seed=2, token_ids=token_ids)
    assert len({r.prompt[:256] for r in requests}) == 1 and len({r.prompt[256] for r in requests}) > 1
    assert all(272 <= len(r.prompt) <= 288 and 8 <= r.max_tokens <= 32 for r in requests)
    with pytest.raises(ValueError, match="prefix_tokens must be between 1 and 448"):
        shared_prefix_workload(4, 512, 449, token_ids=token_ids)


def test_bench_serve_shared_prefix_json_counts_the_prefill_it_saved(python_process):
    env = {**os.environ, "COURSE_SMOKE": "1"}
    command = ["bench-serve", "--workload", "shared-prefix", "--json", "--requests", "6", "--max-batch", "2",
               "--repeats", "1", "--prefix-tokens", "24", "--device", "cpu"]
    done = python_process("-m", "helpers", *command, check=True, cwd=REPO_ROOT, env=env)
    report = json.loads(done.stdout)
    assert report["shared_prefix_tokens"] >= 24 and report["token_identical"] is True
    assert report["cached_tokens_no_sharing"] == 0 and report["prefix_hit_rate_no_sharing"] == 0
    for name in ("no_sharing", "prefix_caching"):
        assert report[f"prefill_tokens_{name}"] + report[f"cached_tokens_{name}"] == report["prompt_tokens"]
        assert 0 < report[f"ttft_p50_s_{name}"] <= report[f"ttft_p90_s_{name}"] <= report[f"ttft_p99_s_{name}"]
    # with two slots, at least the four requests after the first two find the shared prefix
    assert report["cached_tokens_prefix_caching"] >= 4 * 24
    assert report["prefix_hit_rate_prefix_caching"] == pytest.approx(
        report["cached_tokens_prefix_caching"] / report["prompt_tokens"])
