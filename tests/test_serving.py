"""The paged KV cache and the serving engine, against references: exact block accounting, attention through
block tables vs contiguous attention in float64, and every engine's tokens vs `GPT.generate` greedy in float64
(batched float32 kernels round differently from single-sequence ones, so float64 makes the comparison exact)."""

import dataclasses
import json
import math
import os

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.__main__ import main
from helpers.inference.paged_kv import BatchRow, BlockAllocator, OutOfBlocks, PagedBatch, PagedKVCache, attend
from helpers.inference.scheduler import Chunk
from helpers.inference.serving import Engine, Request, RequestRefused, contiguous_layout, serve
from helpers.measure.serving_bench import mixed_workload, reference_tokens
from helpers.model.attention import IMPLEMENTATIONS, attend_cache
from helpers.model.decoding import Sampling
from helpers.notebooks import ROOT

CONFIG = GPTConfig(vocab_size=97, context_length=48, d_model=32, n_heads=2, n_layers=2, dropout=0.0)


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    return GPT(CONFIG).double().eval()


def mixed_requests(n, seed=1, max_prompt=20, max_out=16):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, CONFIG.vocab_size, (int(torch.randint(1, max_prompt + 1, (1,), generator=g)),),
                               generator=g)
        out.append(Request(f"r{i}", tuple(prompt.tolist()), int(torch.randint(1, max_out + 1, (1,), generator=g))))
    return out


@pytest.fixture(scope="module")
def requests_and_reference(model64):
    requests = mixed_requests(9)
    return requests, {r.request_id: reference_tokens(model64, r) for r in requests}


# ---- the block allocator ----


def test_allocator_accounting_is_exact_and_all_or_nothing():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(4)
    assert len(set(a + b)) == 7 and set(a + b) <= set(range(8))
    assert (alloc.num_used, alloc.num_free) == (7, 1)
    with pytest.raises(OutOfBlocks, match="2 blocks requested but only 1 of 8 are free"):
        alloc.allocate(2)
    assert (alloc.num_used, alloc.num_free) == (7, 1)  # the failed request took nothing
    alloc.free(a)
    assert (alloc.num_used, alloc.num_free) == (4, 4)
    c = alloc.allocate(4)  # the freed blocks (and the spare) are reused: no fragmentation with fixed-size blocks
    assert set(c) == set(range(8)) - set(b)
    assert alloc.num_free == 0


def test_allocator_refuses_double_and_foreign_frees():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks[:1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(blocks[:1])
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([3])
    with pytest.raises(ValueError, match="duplicates"):
        alloc.free([blocks[1], blocks[1]])
    assert (alloc.num_used, alloc.num_free) == (1, 3)
    with pytest.raises(ValueError, match="positive integer"):
        BlockAllocator(0)


def test_cache_reserves_ceil_blocks_and_releases_them():
    cache = PagedKVCache(n_layers=1, n_heads=1, head_dim=2, num_blocks=10, block_size=4)
    cache.reserve("a", 5)  # ceil(5 / 4) = 2 blocks
    cache.reserve("b", 4)
    cache.reserve("a", 8)  # still 2
    assert [len(cache.block_tables[s]) for s in "ab"] == [2, 1]
    assert cache.allocated_slots == 12 and cache.allocator.num_free == 7
    assert cache.can_hold("a", 36) and not cache.can_hold("a", 37)
    with pytest.raises(OutOfBlocks):
        cache.reserve("c", 40)
    assert "c" not in cache.block_tables and cache.allocator.num_free == 7
    cache.release("a")
    assert cache.allocated_slots == 4 and cache.allocator.num_free == 9
    with pytest.raises(ValueError, match="beyond its reserved blocks"):
        cache.slots("b", 0, 5)


# ---- attention through block tables ----


def fragmented_cache(lengths, block_size=3, heads=2, head_dim=4):
    """A cache whose sequences hold interleaved, out-of-order blocks, filled with known keys and values."""
    torch.manual_seed(0)
    cache = PagedKVCache(1, heads, head_dim, num_blocks=40, block_size=block_size, dtype=torch.float64)
    cache.allocator.allocate(5)  # some blocks in use by "someone else"
    kv = {}
    for step in range(max(lengths)):  # grow the sequences in turn, so their blocks interleave
        for i, n in enumerate(lengths):
            if step < n:
                cache.reserve(i, step + 1)
    for i, n in enumerate(lengths):
        k, v = torch.randn(2, n, heads, head_dim, dtype=torch.float64)
        cache.write(0, cache.slots(i, 0, n), k, v)
        kv[i] = (k.transpose(0, 1), v.transpose(0, 1))  # (heads, n, head_dim)
    return cache, kv


def reference_attention(q, k, v, start):
    """float64 softmax(q k^T / sqrt(d)) v with query i at position start + i seeing keys 0..start + i."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    future = torch.arange(k.size(-2)) > torch.arange(start, start + q.size(-2))[:, None]
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def test_gather_reads_back_what_was_written_through_the_block_table():
    cache, kv = fragmented_cache([7, 2, 11])
    table = cache.block_tables[2]
    assert any(b - a != 1 for a, b in zip(table, table[1:], strict=False)), "the blocks should be scattered"
    for i, (k, v) in kv.items():
        k_read, v_read = cache.gather(0, i, k.size(1))
        assert torch.equal(k_read, k) and torch.equal(v_read, v)


@pytest.mark.parametrize("start, n", [(0, 11), (4, 7), (10, 1)])
def test_paged_attention_matches_contiguous_attention_in_float64(start, n):
    cache, kv = fragmented_cache([11])
    k, v = kv[0]
    q = torch.randn(2, n, 4, dtype=torch.float64)
    k_read, v_read = cache.gather(0, 0, start + n)
    out = attend(q, k_read, v_read, start)
    torch.testing.assert_close(out, reference_attention(q, k[:, : start + n], v[:, : start + n], start),
                               rtol=1e-12, atol=1e-12)


def test_a_ragged_batch_attends_through_the_block_tables_like_the_reference():
    """Two decoding tokens and a chunk after 4 cached positions in one row (`PagedBatch`): the model's backend over
    what each group reads (the decoding tokens batched, padded to the longest) against float64 attention per
    sequence."""
    lengths = [7, 2, 11]
    cache, kv = fragmented_cache(lengths)
    rows = [BatchRow(0, 6, 1), BatchRow(1, 1, 1), BatchRow(2, 4, 7)]
    batch = PagedBatch(cache, rows)
    new_k, new_v = (torch.cat([kv[i][j][:, start : start + n] for i, start, n in rows], dim=1)[None] for j in (0, 1))
    q = torch.randn(1, 2, 9, 4, dtype=torch.float64)
    out = attend_cache(IMPLEMENTATIONS["sdpa"], q, batch.update(0, new_k, new_v))[0]
    offset = 0
    for i, start, n in rows:
        k, v = kv[i]
        torch.testing.assert_close(out[:, offset : offset + n], reference_attention(
            q[0, :, offset : offset + n], k[:, : start + n], v[:, : start + n], start), rtol=1e-12, atol=1e-12)
        offset += n


# ---- the engine: token-identical to GPT.generate ----


@pytest.mark.parametrize("engine_args", [
    {"max_batch": 3, "block_size": 4},  # continuous batching on a paged cache, 9 requests through 3 slots
    {"max_batch": 4, "block_size": 5, "max_step_tokens": 6},  # long prompts prefilled in chunks
    {"max_batch": 3, "scheduling": "static", **contiguous_layout(CONFIG.context_length, 3)},
    {"max_batch": 3, "scheduling": "static", "block_size": 4},
], ids=["continuous", "chunked-prefill", "static-contiguous", "static-paged"])
def test_engine_is_token_identical_to_generate(model64, requests_and_reference, engine_args):
    requests, expected = requests_and_reference
    run = serve(model64, requests, **engine_args)
    assert [c.request_id for c in run.completions] == [r.request_id for r in requests]
    for c in run.completions:
        assert c.tokens == expected[c.request_id], c.request_id
        assert c.finish_reason == "length"
    assert run.generated_tokens == sum(r.max_tokens for r in requests)


def test_a_cache_too_small_for_all_preempts_and_recomputes_with_identical_tokens(model64, requests_and_reference):
    requests, expected = requests_and_reference
    need = max(math.ceil((len(r.prompt) + r.max_tokens - 1) / 4) for r in requests)
    run = serve(model64, requests, max_batch=6, block_size=4, num_blocks=need + 1)
    assert run.preemptions > 0
    assert all(c.tokens == expected[c.request_id] for c in run.completions)
    assert all(0 < i.used_slots <= i.allocated_slots <= (need + 1) * 4 for i in run.iterations)


def test_static_batch_waits_for_its_longest_request_and_continuous_does_not(model64):
    requests = [Request("long", (1, 2, 3), 20), Request("short", (4, 5), 2), Request("late", (6,), 2)]
    cont = serve(model64, requests, max_batch=2, block_size=4)
    stat = serve(model64, requests, max_batch=2, scheduling="static", block_size=4)
    c, s = ({x.request_id: x for x in run.completions} for run in (cont, stat))
    assert c["late"].latency_s < c["long"].latency_s  # joined when "short" finished
    assert s["late"].first_token_s > s["long"].latency_s  # waited for the whole first batch
    # "short" is done after 2 of the batch's 20 iterations and pads the other 18; continuous never pads
    assert sum(i.padding_rows for i in stat.iterations) == 18
    assert sum(i.padding_rows for i in cont.iterations) == 0


def test_eos_stops_a_request_early(model64):
    request = Request("a", (5, 6, 7), 12)
    full = reference_tokens(model64, request)
    eos = full[4]
    cut = full[: full.index(eos) + 1]
    other = Request("b", (8, 9), 12)
    run = serve(model64, [Request("a", request.prompt, 12, eos_id=eos), other], max_batch=2, block_size=4)
    assert run.completions[0].tokens == cut and run.completions[0].finish_reason == "eos"
    assert run.completions[1].tokens == reference_tokens(model64, other)


SAMPLINGS = [Sampling(temperature=0.9, top_k=20), Sampling(temperature=1.3, top_p=0.9),
             Sampling(repetition_penalty=1.5),  # greedy, penalised: needs the context, draws nothing
             Sampling(temperature=0.7, frequency_penalty=0.5, presence_penalty=0.3), Sampling()]


@pytest.mark.parametrize("engine_args", [
    {"max_batch": 4, "block_size": 5, "max_step_tokens": 6},  # long prompts prefilled in chunks
    {"max_batch": 6, "block_size": 4, "num_blocks": 7},  # too small for all: preempted and recomputed
    {"max_batch": 3, "scheduling": "static", "block_size": 4},  # padding rows
], ids=["chunked-prefill", "preempting", "static"])
def test_each_request_samples_what_generate_draws_for_it_alone(model64, engine_args):
    """Its own sampling and a generator of its own seed: the same tokens whichever requests share its batches,
    through chunked prefill, preemption and padding."""
    requests = [Request(r.request_id, r.prompt, r.max_tokens, sampling=SAMPLINGS[i % len(SAMPLINGS)], seed=100 + i)
                for i, r in enumerate(mixed_requests(10, seed=2))]
    run = serve(model64, requests, **engine_args)
    assert engine_args.get("num_blocks") is None or run.preemptions > 0
    for request, completion in zip(requests, run.completions, strict=True):
        assert completion.tokens == reference_tokens(model64, request), request.request_id
    greedy = serve(model64, [Request(r.request_id, r.prompt, r.max_tokens) for r in requests], **engine_args)
    assert [c.tokens for c in greedy.completions] != [c.tokens for c in run.completions]  # sampling did sample


def test_sampled_first_tokens_follow_the_models_distribution(model64):
    prompt, draws = (3, 1, 4, 1, 5), 3000
    with torch.no_grad():
        probs = model64(torch.tensor([prompt]))[0, -1].float().softmax(-1).double()
    run = serve(model64, [Request(i, prompt, 1, sampling=Sampling(temperature=1.0), seed=i) for i in range(draws)],
                max_batch=64, block_size=8)
    counts = torch.bincount(torch.tensor([c.tokens[0] for c in run.completions]), minlength=CONFIG.vocab_size)
    expected = draws * probs
    big = expected >= 5  # Pearson's test: the tokens expected fewer than 5 times counted as one category
    observed, expected = counts[big].double(), expected[big]
    if not big.all():
        observed = torch.cat([observed, counts[~big].sum(0, keepdim=True).double()])
        expected = torch.cat([expected, draws * probs[~big].sum(0, keepdim=True)])
    chi_square, df = float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1
    assert chi_square < df + 5 * (2 * df) ** 0.5, (chi_square, df)  # mean df, standard deviation sqrt(2 df)


def test_unseeded_sampling_follows_torch_manual_seed(model64):
    requests = [Request(i, (7, 8, 9), 10, sampling=Sampling(temperature=1.0)) for i in range(3)]
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append([c.tokens for c in serve(model64, requests, max_batch=3, block_size=4).completions])
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) > 1  # reproducible; each request its own draws
    with pytest.raises(ValueError, match="samples without a seed"):
        reference_tokens(model64, requests[0])


def test_utilization_paged_wastes_less_than_a_block_per_sequence(model64, requests_and_reference):
    requests, _ = requests_and_reference
    paged = serve(model64, requests, max_batch=3, block_size=4)
    contiguous = serve(model64, requests, max_batch=3, **contiguous_layout(CONFIG.context_length, 3))
    for i in paged.iterations:
        assert 0 <= i.allocated_slots - i.used_slots < 4 * 3
    assert paged.kv_utilization > contiguous.kv_utilization
    assert all(i.allocated_slots % CONFIG.context_length == 0 for i in contiguous.iterations)


# ---- bad input ----


@pytest.mark.parametrize("request_, field, message", [
    (Request("x", tuple(range(49)), 1), "prompt", "the prompt has 49 tokens but the context length is 48"),
    (Request("x", tuple(range(40)), 10), "max_tokens", "set max_tokens to 9 or less"),
    (Request("x", (1, 2), 0), "max_tokens", "max_tokens must be an integer >= 1"),
    (Request("x", (), 3), "prompt", "the prompt is empty"),
    (Request("x", (1, 97), 3), "prompt", r"prompt token ids must be integers in \[0, 97\)"),
    (Request("x", (1, 2), 3, eos_id=-1), "eos_id", "eos_id -1 is outside"),
    (Request("x", tuple(range(20)), 20), "max_tokens", "needs 5 blocks of 8 tokens but the cache has only 4"),
    (Request("x", (1, 2), 3, sampling=Sampling(temperature=-1.0)), "sampling", "request 'x': temperature must be >= 0"),
    (Request("x", (1, 2), 3, sampling=Sampling(temperature=1.0, top_k=98)), "sampling",
     r"top_k must be an integer in \[1, 97\]"),
    (Request("x", (1, 2), 3, sampling={"temperature": 1.0}), "sampling",
     "sampling must be a helpers.model.decoding.Sampling"),
])
def test_requests_that_can_never_be_served_are_refused_at_submit(model64, request_, field, message):
    engine = Engine(model64, max_batch=2, block_size=8, num_blocks=4)
    with pytest.raises(RequestRefused, match=message) as checked:  # what a server asks before it queues
        engine.check(request_)
    assert checked.value.field == field
    with pytest.raises(ValueError, match=message):
        engine.submit(request_)
    assert not engine.has_work


def test_duplicate_ids_and_bad_engine_arguments_are_refused(model64):
    engine = Engine(model64, max_batch=2)
    engine.submit(Request("a", (1,), 1))
    with pytest.raises(ValueError, match="already queued"):
        engine.submit(Request("a", (2,), 1))
    with pytest.raises(ValueError, match="unknown scheduling"):
        Engine(model64, max_batch=2, scheduling="dynamic")
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        Engine(model64, max_batch=0)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        Engine(model64, max_batch=1, block_size=0)
    with pytest.raises(RuntimeError, match="submit first"):
        Engine(model64, max_batch=1).step()
    with pytest.raises(RuntimeError, match="submit requests first"):
        Engine(model64, max_batch=1).run()


def step_until_done(engine, max_iterations=200):
    """Step an engine a bounded number of times (a stalled engine fails the test instead of hanging it)."""
    completions = []
    for _ in range(max_iterations):
        if not engine.has_work:
            return completions
        completions += engine.step()
    raise AssertionError(f"the engine still had work after {max_iterations} iterations: it makes no progress")


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
@pytest.mark.parametrize("max_step_tokens", [1, 2, 3])
def test_a_small_token_budget_slows_a_batch_but_never_stalls_it(model64, scheduling, max_step_tokens):
    """Finished rows of a static batch pad with what budget is left: they must not starve unfinished ones."""
    engine = Engine(model64, max_batch=2, block_size=4, scheduling=scheduling, max_step_tokens=max_step_tokens)
    requests = [Request("A", (1,), 1), Request("B", (2, 3), 5), Request("C", (4, 5, 6), 3)]
    for r in requests:
        engine.submit(r)
    done = {c.request_id: c.tokens for c in step_until_done(engine)}
    assert done == {r.request_id: reference_tokens(model64, r) for r in requests}


def test_an_iteration_in_which_no_sequence_advances_is_an_error(model64, monkeypatch):
    engine = Engine(model64, max_batch=2, scheduling="static")
    engine.submit(Request("A", (1,), 1))
    engine.submit(Request("B", (2, 3), 4))
    engine.step(), engine.step()  # A is finished, B is decoding
    finished = next(s for s in engine.scheduler.running if s.finish_reason is not None)
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: ([Chunk(finished, finished.num_computed - 1, 1)], 0))
    with pytest.raises(RuntimeError, match="no sequence advances"):
        engine.step()


def test_more_requests_than_the_cache_holds_at_once_are_queued(model64):
    requests = [Request(i, (i + 1, i + 2, i + 3), 6) for i in range(12)]  # 8 tokens each: one 8-token block
    engine = Engine(model64, max_batch=8, block_size=8, num_blocks=2)
    for r in requests:
        engine.submit(r)
    run = engine.run()
    assert all(i.allocated_slots <= 16 for i in run.iterations)
    assert max(i.waiting for i in run.iterations) >= 9
    assert [c.tokens for c in run.completions] == [reference_tokens(model64, r) for r in requests]


# ---- the workload and bench-serve ----


def test_mixed_workload_fits_the_context_and_is_seeded():
    token_ids = torch.arange(5000) % 50000
    a = mixed_workload(200, 256, seed=3, token_ids=token_ids)
    assert a == mixed_workload(200, 256, seed=3, token_ids=token_ids)
    prompts, outputs = [len(r.prompt) for r in a], [r.max_tokens for r in a]
    assert 8 <= min(prompts) and max(prompts) <= 64 and 4 <= min(outputs) and max(outputs) <= 128
    assert all(len(r.prompt) + r.max_tokens - 1 <= 256 for r in a)
    assert sorted(outputs)[100] < sum(outputs) / len(outputs)  # skewed: the median below the mean


def test_bench_serve_cli_says_when_the_cache_is_too_small(capsys):
    with pytest.raises(SystemExit, match="2"):
        main(["bench-serve", "--model", "gpt-smoke", "--requests", "2", "--num-blocks", "1", "--device", "cpu"])
    assert "but the cache has only 1; give the engine more num_blocks" in capsys.readouterr().err


def test_bench_serve_json_has_consistent_keys(python_process):
    env = {**os.environ, "COURSE_SMOKE": "1"}
    command = ["bench-serve", "--json", "--requests", "4", "--max-batch", "2", "--repeats", "1", "--device", "cpu"]
    done = python_process("-m", "helpers", *command, check=True, cwd=ROOT, env=env)
    report = json.loads(done.stdout)
    assert report["model"] == "gpt-smoke" and report["requests"] == 4 and report["block_size"] == 8
    assert report["throughput_ratio"] == pytest.approx(report["tokens_per_s_continuous"]
                                                       / report["tokens_per_s_static"], rel=1e-12)
    assert report["token_identical"] is True and report["token_identical_requests"] == 4
    for name in ("continuous", "continuous_contiguous", "static"):
        q1, q3 = report[f"tokens_per_s_iqr_{name}"]
        assert q1 <= report[f"tokens_per_s_{name}"] <= q3
        iterations = report[f"iterations_{name}"]
        assert report[f"tokens_per_forward_{name}"] == pytest.approx(report["generated_tokens"] / iterations)
    # the two continuous engines run the same schedule
    assert report["iterations_continuous"] == report["iterations_continuous_contiguous"]
    assert report["paged_vs_contiguous"].startswith("paged ") and report["continuous_vs_static"]
    for key in ("kv_utilization_paged", "kv_utilization_contiguous", "kv_utilization_static"):
        assert 0 < report[key] <= 1
    assert report["kv_utilization_paged"] > report["kv_utilization_contiguous"]
    for name in ("continuous", "continuous_contiguous", "static"):
        p = [report[f"latency_{q}_s_{name}"] for q in ("p50", "p90", "p99")]
        assert 0 < p[0] <= p[1] <= p[2]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_aborted_requests_free_their_blocks_and_the_others_keep_their_tokens(model64, requests_and_reference,
                                                                           scheduling):
    """A client that goes away: its request leaves the queue or the batch at once, every block it held is free again,
    and the requests that stay get exactly the tokens they get alone."""
    requests, reference = requests_and_reference
    engine = Engine(model64, max_batch=3, block_size=4, scheduling=scheduling)
    for request in requests:
        engine.submit(request)
    engine.step()  # the first batch is running, the rest wait
    running = [s.request.request_id for s in engine.scheduler.running]
    waiting = [s.request.request_id for s in engine.scheduler.waiting]
    dropped = {running[0], waiting[-1]}
    assert all(engine.abort(rid) for rid in dropped)
    assert not engine.abort(running[0]) and not engine.abort("no such request")
    assert engine.live_requests == len(requests) - 2
    completions = step_until_done(engine)
    assert {c.request_id for c in completions} == {r.request_id for r in requests} - dropped
    for c in completions:
        assert c.tokens == reference[c.request_id], c.request_id
    assert engine.cache.allocator.num_used == 0 and engine.live_requests == 0


def test_generated_shows_a_requests_tokens_as_they_come(model64, requests_and_reference):
    requests, reference = requests_and_reference
    engine = Engine(model64, max_batch=2)
    engine.submit(requests[0])
    seen = []
    while engine.has_work:
        done = engine.step()
        if not done:
            seen.append(engine.generated(requests[0].request_id))
    assert seen == [reference[requests[0].request_id][:n] for n in range(1, len(seen) + 1)]
    assert len(seen) == len(reference[requests[0].request_id]) - 1  # the last token arrives with the completion
    assert done[0].tokens == reference[requests[0].request_id]


def test_a_static_batch_whose_last_unfinished_row_is_aborted_lets_its_finished_rows_go(model64, requests_and_reference):
    """The finished rows of a static batch wait as padding for its longest request; when a client takes that one away,
    they complete at the next step (there is nothing left to compute) instead of an iteration with no work."""
    requests, reference = requests_and_reference
    short, long_ = (dataclasses.replace(requests[0], request_id="short", max_tokens=2),
                    dataclasses.replace(requests[1], request_id="long", max_tokens=12))
    engine = Engine(model64, max_batch=2, block_size=4, scheduling="static")
    engine.submit(short)
    engine.submit(long_)
    while not any(s.finish_reason for s in engine.scheduler.running):
        assert engine.step() == []
    assert engine.abort("long")
    done = engine.step()
    assert [c.request_id for c in done] == ["short"] and done[0].tokens == reference[requests[0].request_id][:2]
    assert engine.last_iteration is None and not engine.has_work and engine.cache.allocator.num_used == 0
