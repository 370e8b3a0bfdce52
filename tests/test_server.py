"""The HTTP server over the engine, against references: the tokens of `generate_with_cache` in float64 (so batched and
single-sequence kernels agree exactly), Python's own string search for stop strings, `transformers`' tokenizer for
the tokenizer files, and the official `openai` client for the API's shapes.

In-process tests check the pieces (the text stream, the tokenizer files, the engine loop, the API's refusals); the
others start `python -m helpers serve` on a free loopback port, one server per module, always stopped."""

import asyncio
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.kv_cache import generate_with_cache
from helpers.inference.scheduler import Request
from helpers.inference.serving import Engine, RequestRefused
from helpers.measure.load_test import RequestResult, check_loopback, format_table, load_test, summarize, workload
from helpers.measure.serving_race import format_race, medians, race
from helpers.model.decoding import GREEDY, Sampling
from helpers.serving.api import create_app
from helpers.serving.checkpoint import PLAIN_CHAT_TEMPLATE, export_for_serving, load_for_serving
from helpers.serving.engine_loop import EngineLoop, EngineStopped, QueueFull, Update
from helpers.serving.engine_process import EngineProcess, EngineSettings
from helpers.serving.metrics import scrape
from helpers.serving.server import LOOPBACK, free_port, launch, start_server
from helpers.serving.text_stream import TextStream
from helpers.text.bpe import train_bpe
from helpers.text.tokenizer import get_tokenizer
from helpers.text.tokenizer_files import TokenizerFilesError, load_tokenizer_files, save_tokenizer_files, token_bytes

TEXT = ("The quick brown fox jumps over the lazy dog. Ça coûte 12 €, naïve café! 日本語のテキスト. "
        "def main():\n    return 42\n") * 20
EOT = "<|endoftext|>"


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(TEXT, 320, special_tokens=[EOT])


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer):
    """A small random GPT and its tokenizer, exported for serving."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=64, d_model=32, n_heads=2, n_layers=2,
                       dropout=0.0)
    return export_for_serving(GPT(config), tokenizer, tmp_path_factory.mktemp("served") / "tiny")


@pytest.fixture(scope="module")
def served64(folder):
    return load_for_serving(folder, dtype=torch.float64)


# ---- the text stream ----


def stream_text(tokens, tokenizer, stop=()):
    stream = TextStream(lambda t: token_bytes(tokenizer, t), stop)
    pieces = [stream.push(t) for t in tokens]
    return pieces + [stream.finish()], stream.stopped


@pytest.mark.parametrize("stop", [(), ("fox",), ("é, n", "lazy"), ("42\nThe",), ("not in the text",)])
def test_streamed_text_is_the_decoded_text_cut_before_the_first_stop(tokenizer, stop):
    """The pieces add up to Python's decode of all the tokens, cut where str.find sees the first stop string; no
    piece shows half a character or any part of a stop string that later completes."""
    tokens = tokenizer.encode(TEXT[:400])
    text = tokenizer.decode(tokens)
    cut = min([i for i in (text.find(s) for s in stop) if i >= 0], default=len(text))
    pieces, stopped = stream_text(tokens, tokenizer, stop)
    assert "".join(pieces) == text[:cut]
    assert stopped == (cut < len(text))
    assert "\ufffd" not in "".join(pieces)
    assert sum(bool(p) for p in pieces) > 5  # it streams, rather than holding everything to the end


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    byte_tokens = list("日本".encode())  # six one-byte tokens of a byte-level vocabulary

    class Bytes:
        special_tokens: dict = {}
        token_bytes = [bytes([b]) for b in range(256)]

    pieces, _ = stream_text(byte_tokens, Bytes())
    assert pieces == ["", "", "日", "", "", "本", ""]
    cut_short, _ = stream_text(byte_tokens[:4], Bytes())
    assert "".join(cut_short) == "日\ufffd"  # a text that ends mid-character shows U+FFFD, as bytes.decode does


def test_text_held_for_a_stop_string_is_released_when_it_stops_matching():
    class Chars:
        special_tokens: dict = {}
        token_bytes = [bytes([b]) for b in range(256)]

    pieces, stopped = stream_text(b"User said: Use it", Chars(), stop=("User:",))
    assert "".join(pieces) == "User said: Use it" and not stopped
    assert pieces[:4] == ["", "", "", ""]  # "User" could still become "User:"
    assert pieces[4] == "User "


# ---- tokenizer files ----


def test_a_course_tokenizer_round_trips_and_transformers_reads_the_same_ids(tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer_files(tokenizer, tmp_path, chat_template=PLAIN_CHAT_TEMPLATE)
    back = load_tokenizer_files(tmp_path)
    assert back.merges == tokenizer.merges and back.special_tokens == tokenizer.special_tokens
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = TEXT[:300] + EOT + " and more"
    assert theirs(text)["input_ids"] == tokenizer.encode(text, allowed_special={EOT})
    assert theirs.eos_token_id == tokenizer.special_tokens[EOT]


def test_gpt2s_tokenizer_is_saved_as_gpt2s_files_and_read_back_as_tiktoken(tmp_path):
    transformers = pytest.importorskip("transformers")
    save_tokenizer_files(get_tokenizer(), tmp_path)
    assert load_tokenizer_files(tmp_path) is get_tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs(TEXT[:300])["input_ids"] == get_tokenizer().encode(TEXT[:300])


def test_tokenizer_files_of_another_kind_are_refused_with_the_reason(tokenizer, tmp_path):
    with pytest.raises(TokenizerFilesError, match="has no vocab.json"):
        load_tokenizer_files(tmp_path)
    save_tokenizer_files(tokenizer, tmp_path)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    first, second = next(iter(vocab)), list(vocab)[1]
    vocab[first], vocab[second] = vocab[second], vocab[first]  # byte ids in another order (as GPT-2's own are)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(TokenizerFilesError, match="does not give byte b the id b"):
        load_tokenizer_files(tmp_path)


def test_a_client_cannot_end_a_document_by_writing_the_special_tokens_name(served64):
    ids = served64.encode("a" + EOT)
    assert served64.eos_id not in ids and served64.tokenizer.decode(ids) == "a" + EOT


# ---- the engine loop ----


def reference(served, prompt, max_tokens, sampling=GREEDY, seed=None):
    """generate_with_cache's tokens, cut after the end-of-text token."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = generate_with_cache(served.model, torch.tensor([prompt]), max_tokens, sampling, generator)[0, len(prompt):]
    tokens = out.tolist()
    return tokens[: tokens.index(served.eos_id) + 1] if served.eos_id in tokens else tokens


def text_of(served, tokens):
    """What a client sees of the tokens: their text, the end-of-text token not written."""
    return served.tokenizer.decode([t for t in tokens if t != served.eos_id])


class Collector:
    def __init__(self):
        self.updates, self.done, self.on_first_token = [], threading.Event(), None

    def __call__(self, update: Update):
        self.updates.append(update)
        if self.on_first_token is not None and len(self.updates) == 1:
            self.on_first_token()
        if update.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self):
        return [t for u in self.updates for t in u.tokens]


def test_requests_arriving_while_others_run_get_generate_with_caches_tokens(served64):
    loop = EngineLoop(Engine(served64.model, max_batch=4, block_size=8, prefix_caching=True), max_waiting=8).start()
    try:
        shared = TEXT[:70]  # a prefix of several blocks, computed once
        prompts = [served64.encode(shared + t) for t in ("", " The quick", " def main", " naïve café")]
        collectors = []
        for i, prompt in enumerate(prompts):
            collectors.append(Collector())
            loop.submit(Request(i, tuple(prompt), 12 + i), collectors[-1])
            if i == 0:  # the others join the running batch once the first has its prompt in the cache
                wait_for(lambda: collectors[0].updates, 60, "the first request produced no token")
        for c in collectors:
            assert c.done.wait(60)
        for prompt, c, i in zip(prompts, collectors, range(4), strict=True):
            assert c.tokens == reference(served64, prompt, 12 + i)
            assert c.updates[-1].finish_reason == "length"
            assert len(c.updates) > 2  # tokens came as they were generated, not all at the end
        assert loop.stats.blocks_used == 0 and loop.stats.running == 0
        assert loop.stats.prefix_hit_rate > 0  # "The quick" and "The quick brown" share blocks
    finally:
        loop.stop(10)
    assert not loop.alive


def test_the_loop_refuses_past_its_capacity_and_ends_live_requests_when_stopped(served64):
    loop = EngineLoop(Engine(served64.model, max_batch=1), max_waiting=1)  # not started: requests stay queued
    first, second = Collector(), Collector()
    loop.submit(Request("a", (1, 2), 5), first)
    loop.submit(Request("b", (1, 2), 5), second)
    with pytest.raises(QueueFull):
        loop.submit(Request("c", (1, 2), 5), Collector())
    first.on_first_token = lambda: loop.stop()  # stops the loop from its own thread, mid-request
    loop.start()
    assert first.done.wait(60) and second.done.wait(60)
    assert [u.finish_reason for u in first.updates] == [None, "abort"]
    assert [u.finish_reason for u in second.updates] == ["abort"]  # it was waiting for the batch of one
    assert not loop.engine.cache.allocator.num_used and not loop.engine.live_requests
    loop.stop(30)
    assert not loop.alive


# ---- the API in process (no engine running: requests stay queued) ----


def in_process_client(served, loop=None, **options):
    """A client of the app in this process; its engine loop is not started (requests stay queued) unless given."""
    loop = loop or EngineLoop(Engine(served.model, max_batch=1), max_waiting=options.pop("max_waiting", 0))
    transport = httpx.ASGITransport(app=create_app(served, loop, **options))
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def test_a_full_queue_is_answered_429_at_once(served64):
    loop = EngineLoop(Engine(served64.model, max_batch=1), max_waiting=1)

    async def scenario():
        async with in_process_client(served64, loop) as client:
            body = {"model": "tiny", "prompt": "The", "max_tokens": 4}
            held = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            while loop.admitted < 2:  # both are queued, and the engine is not running
                await asyncio.sleep(0.01)
            refused = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
            for task in held:
                task.cancel()
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 429
    assert refused.json()["error"]["type"] == "rate_limit_error"


def test_an_api_key_is_required_when_set(served64):
    async def scenario():
        async with in_process_client(served64, api_key="s3cret") as client:
            return [await client.get("/v1/models", headers=headers) for headers in
                    ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cret"})] + \
                [await client.get("/health")]

    missing, wrong, right, health = asyncio.run(scenario())
    assert missing.status_code == wrong.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"
    assert right.status_code == 200 and right.json()["data"][0]["id"] == "tiny"
    assert health.status_code == 503  # no key needed (and the engine loop of this app was never started)


# ---- a real server on a loopback port ----


@pytest.fixture(scope="module")
def server(folder):
    """One server for the module, float64 so batched kernels match generate_with_cache exactly."""
    with start_server(folder, "--dtype", "float64", "--max-batch", "4", "--max-waiting", "64",
                      "--block-size", "8", "--max-body-bytes", "20000", "--graceful-seconds", "1") as running:
        yield running
        assert running.process.poll() is None, "the server died during the tests"


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.mark.timeout(120)
def test_completions_streamed_or_not_are_generate_with_caches_tokens(client, served64):
    prompt = "The quick brown"
    ids = served64.encode(prompt)
    expected = text_of(served64, reference(served64, ids, 20))
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), 20)
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert len(chunks) > 3 and chunks[-1].choices[0].finish_reason == "length"
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == expected


@pytest.mark.timeout(120)
def test_concurrent_requests_each_get_their_own_tokens(client, served64):
    """Requests that share the running batch (continuous batching, shared prefixes) get what each gets alone."""
    prompts = [f"The quick brown fox {word}" for word in ("jumps", "runs", "naïve", "日本", "def", "café")]

    def ask(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    results = {}
    threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, ask(p))) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    for p in prompts:
        assert results[p] == text_of(served64, reference(served64, served64.encode(p), 16)), p


@pytest.mark.timeout(120)
def test_a_seeded_sampled_request_is_reproducible(client, served64):
    def ask(seed):
        return client.completions.create(model="tiny", prompt="The", max_tokens=24, temperature=1.0, seed=seed,
                                         extra_body={"top_k": 50}).choices[0].text

    first, again = ask(7), ask(7)
    sampling = Sampling(temperature=1.0, top_k=50)
    expected = text_of(served64, reference(served64, served64.encode("The"), 24, sampling, seed=7))
    assert first == again == expected


@pytest.mark.timeout(120)
def test_stop_strings_end_the_text_before_them_across_token_boundaries(client, served64):
    ids = served64.encode("naïve")
    full = text_of(served64, reference(served64, ids, 40))
    stop = full[9:13]  # four characters from the middle of the text, whatever tokens they span
    expected = full[: full.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model="tiny", prompt="naïve", max_tokens=40, temperature=0,
                                                    stop=[stop, "never appears"], stream=True))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            answer = client.completions.create(model="tiny", prompt="naïve", max_tokens=40, temperature=0,
                                               stop=[stop, "never appears"])
            text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        assert (text, finish) == (expected, "stop")


@pytest.mark.timeout(120)
def test_chat_goes_through_the_chat_template(client, served64):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    prompt = served64.render_chat(messages)
    assert prompt == "System: Be brief.\n\nUser: Name a fox.\n\nAssistant:"
    expected = text_of(served64, reference(served64, served64.encode(prompt), 12))
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(served64.encode(prompt))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 12


BAD_REQUESTS = [  # (what, path, body or raw bytes, status, the field named)
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("a wrong type", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "5"}, 400, "max_tokens"),
    ("a missing field", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("an unknown model", "/v1/completions", {"model": "gpt-5", "prompt": "a"}, 404, "model"),
    ("negative max_tokens", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": -1}, 400,
     "max_tokens"),
    ("max_tokens past the context", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 500}, 400,
     "max_tokens"),
    ("temperature below 0", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -0.5}, 400,
     "temperature"),
    ("top_p of 0", "/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("top_p above 1", "/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("a prompt longer than the context", "/v1/completions", {"model": "tiny", "prompt": "fox " * 200}, 400,
     "prompt"),
    ("n above 1", "/v1/completions", {"model": "tiny", "prompt": "a", "n": 2}, 400, "n"),
    ("logprobs", "/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 3}, 400, "logprobs"),
    ("an empty stop string", "/v1/completions", {"model": "tiny", "prompt": "a", "stop": ""}, 400, "stop"),
    ("a role that does not exist", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ("a token id outside the vocabulary", "/v1/completions", {"model": "tiny", "prompt": [5, 99999]}, 400,
     "prompt"),
    ("an oversized body", "/v1/completions", {"model": "tiny", "prompt": "a" * 30000}, 413, None),
    ("an oversized body sent in chunks", "/v1/completions",
     iter([b'{"model": "tiny", "prompt": "', b"a" * 30000, b'"}']), 413, None),
    ("a seed outside 64 bits", "/v1/completions", {"model": "tiny", "prompt": "a", "seed": 2**64}, 400, "seed"),
]


@pytest.mark.timeout(120)
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_keeps_serving(server, client):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for what, path, body, status, param in BAD_REQUESTS:
            if not isinstance(body, dict):  # raw bytes, or chunks (no Content-Length)
                response = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                response = http.post(path, json=body)
            assert response.status_code == status, (what, response.text)
            error = response.json()["error"]
            assert error["param"] == param and error["message"], (what, error)
        assert http.get("/health").json()["status"] == "ok"
        for i in range(3):  # paths that do not exist: one series for them all in /metrics
            assert http.get(f"/no-such-path-{i}").status_code == 404
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).usage.completion_tokens == 2
    assert metric(server, 'course_requests_total{endpoint="other",status="404"}') >= 3
    assert "no-such-path" not in httpx.get(server.url + "/metrics", timeout=30).text


def metric(server, name):
    samples = scrape(server.url)
    assert name in samples, f"{name} not in /metrics"
    return samples[name]


def wait_for(condition, timeout, what):
    """Poll until `condition()` holds, failing after `timeout` seconds with `what`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    """Hundreds of streams cut after their first event: every sequence is aborted and no block stays held."""

    async def cut(client, i):
        body = {"model": "tiny", "prompt": f"The quick {i}", "max_tokens": 40, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for start in range(0, 300, 30):
                await asyncio.gather(*(cut(client, i) for i in range(start, start + 30)))

    generated = metric(server, "course_generation_tokens_total")
    asyncio.run(run())
    wait_for(lambda: metric(server, "course_running_sequences") == 0, 60, "aborted sequences still run")
    wait_for(lambda: metric(server, "course_kv_blocks_used") == 0, 60, "aborted sequences still hold blocks")
    # run to the end they would generate about 39 tokens each: aborted, a few (those already in flight)
    assert metric(server, "course_generation_tokens_total") - generated < 300 * 10
    assert metric(server, 'course_requests_total{endpoint="/v1/completions",status="200"}') >= 300


@pytest.mark.timeout(60)
def test_metrics_are_prometheus_text_with_the_servers_counters(server, client):
    client.completions.create(model="tiny", prompt="The quick", max_tokens=3)
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for name in ("course_requests_total", "course_prompt_tokens_total", "course_generation_tokens_total",
                 "course_running_sequences", "course_waiting_sequences", "course_kv_blocks_used",
                 "course_kv_blocks_free", "course_prefix_cache_hit_rate", "course_time_to_first_token_seconds_bucket",
                 "course_inter_token_latency_seconds_bucket"):
        assert f"\n{name}" in text, name
    assert metric(server, "course_time_to_first_token_seconds_count") >= 1


@pytest.mark.timeout(60)
def test_models_health_and_the_chat_page(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
        assert http.get("/health").json() == {"status": "ok", "model": "tiny"}
        page = http.get("/")
        assert page.status_code == 200 and "/v1/chat/completions" in page.text


@pytest.mark.subprocess
@pytest.mark.timeout(180)
def test_sigterm_finishes_or_cancels_what_runs_releases_the_port_and_exits_0(folder):
    server = start_server(folder, "--graceful-seconds", "2")
    try:
        port = int(server.url.rsplit(":", 1)[1])
        body = {"model": "tiny", "prompt": "The", "max_tokens": 60, "stream": True}
        with httpx.Client(base_url=server.url, timeout=60) as http, http.stream("POST", "/v1/completions",
                                                                              json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            server.process.send_signal(signal.SIGTERM)
            try:
                rest = list(lines)  # the stream ends: finished within the grace period, or cut after it
            except httpx.HTTPError:
                rest = []
            assert server.process.wait(60) == 0
            assert all(line.startswith("data: ") for line in rest if line)
        with socket.socket() as s:  # the port is free again for a new server (which sets SO_REUSEADDR, as uvicorn)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((LOOPBACK, port))
            s.listen()
    finally:
        server.stop()


def test_serve_refuses_bad_arguments_with_a_usage_error(python_process, tmp_path):
    result = python_process("-m", "helpers", "serve", "--checkpoint", tmp_path / "missing")
    assert result.returncode == 2 and "no such folder" in result.stderr
    result = python_process("-m", "helpers", "serve", "--checkpoint", tmp_path, "--port", "70000")
    assert result.returncode == 2 and "--port" in result.stderr
    result = python_process("-m", "helpers", "serve", "--checkpoint", tmp_path, "--threads", "0")
    assert result.returncode == 2 and "--threads" in result.stderr


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_the_engine_runs_on_the_threads_it_is_given(folder, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "helpers", "serve", "--checkpoint", str(folder), "--port", str(port),
               "--threads", "1"]
    with launch(command, port, 100, log=log) as running:
        assert httpx.get(running.url + "/health", timeout=30).status_code == 200
    assert "; engine process with 1 CPU threads" in log.read_text()


def test_a_folder_without_a_model_is_refused_in_one_line(python_process, tmp_path):
    result = python_process("-m", "helpers", "serve", "--checkpoint", tmp_path)
    assert result.returncode == 2 and "has no config.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.subprocess
def test_start_server_says_when_the_server_exits_and_stops_one_that_never_answers(folder, tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="exited with code 2 before answering"):
        start_server(tmp_path, timeout=120)
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    with pytest.raises(TimeoutError, match="did not answer"):
        start_server(folder, timeout=0.01)
    assert len(started) == 1 and started[0].poll() is not None  # stopped, not left running


# ---- the load generator and the race ----


def test_the_load_generator_sends_traffic_only_to_loopback(python_process):
    for url in ("http://example.com:8000", "http://10.0.0.1:8000", "ftp://127.0.0.1:21"):
        result = python_process("-m", "helpers", "load-test", url)
        assert result.returncode == 2 and "loopback" in result.stderr, url
    assert check_loopback("http://localhost:8000/") == "http://localhost:8000"


def test_the_workload_is_seeded_and_every_request_fits_when_asked(served64):
    assert workload(20, seed=3) == workload(20, seed=3) != workload(20, seed=4)
    context = served64.context_length
    fitted = workload(50, seed=3, max_tokens=(8, 24), fits=lambda p, m: len(served64.encode(p)) + m <= context)
    assert all(len(served64.encode(r.prompt)) + r.max_tokens <= context for r in fitted)
    assert len({r.prompt for r in fitted}) == 50


def test_a_levels_summary_counts_failures_apart_and_takes_percentiles_as_numpy():
    numpy = pytest.importorskip("numpy")
    ttfts = [0.5, 9.0, 2.0, 4.0, 4.0, 7.5, 1.25]
    results = [RequestResult(True, t, t / 10, 5, 2 * t) for t in ttfts] + [RequestResult(False, error="HTTP 500")]
    summary = summarize(results, wall_s=10.0, concurrency=4)
    assert (summary["requests"], summary["errors"], summary["output_tokens"]) == (8, 1, 35)
    assert summary["tokens_per_s"] == 3.5 and summary["first_error"] == "HTTP 500"
    for p in (50, 90, 99):
        assert summary[f"ttft_p{p}_s"] == pytest.approx(float(numpy.percentile(ttfts, p)))
        assert summary[f"itl_p{p}_s"] == pytest.approx(float(numpy.percentile(ttfts, p)) / 10)
    assert math.isnan(summarize([RequestResult(False, error="x")], 1.0, 1)["ttft_p50_s"])


@pytest.mark.timeout(180)
def test_a_load_test_counts_every_token_and_no_error(server, served64):
    requests = workload(12, seed=1, prompt_words=(2, 6), max_tokens=(4, 12))
    rows = load_test(server.url, [1, 4], requests, max_seconds=120, model="tiny")
    for row in rows:
        assert (row["requests"], row["errors"]) == (12, 0), row["first_error"]
        expected = sum(len(reference(served64, served64.encode(r.prompt), r.max_tokens)) for r in requests)
        assert row["output_tokens"] == expected  # the usage each stream reports, summed
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["tokens_per_s"] > 0
    assert "TTFT p50" in format_table(rows)


@pytest.mark.timeout(120)
def test_the_load_generator_runs_where_an_event_loop_already_runs(server):
    """As in a Jupyter kernel, whose event loop runs in the thread that calls it."""
    requests = workload(4, seed=2, prompt_words=(2, 6), max_tokens=(4, 8))

    async def inside_a_loop():
        return load_test(server.url, [2], requests, max_seconds=60, model="tiny")

    (row,) = asyncio.run(inside_a_loop())
    assert (row["requests"], row["errors"]) == (4, 0), row["first_error"]


@pytest.mark.timeout(120)
def test_a_server_left_running_is_stopped_when_its_interpreter_exits(folder, python_process):
    script = (f"from helpers.serving.server import start_server\nserver = start_server({str(folder)!r})\n"
              "print(server.process.pid, server.url, flush=True)\n")
    result = python_process("-c", script, timeout=100)
    assert result.returncode == 0, result.stderr
    pid, url = result.stdout.split()
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)


@pytest.mark.subprocess
@pytest.mark.timeout(300)
def test_a_race_interleaves_the_contenders_and_reports_medians(folder, tmp_path):
    results = race(folder, ["course", "course-static"], [1, 4], n_requests=6, rounds=2, max_seconds=60,
                   max_batch=4, log_dir=tmp_path)
    assert set(results) == {"course", "course-static"}
    for rounds in results.values():
        assert [[row["concurrency"] for row in levels] for levels in rounds] == [[1, 4], [1, 4]]
        assert all(row["errors"] == 0 and row["requests"] == 6 for levels in rounds for row in levels)
    table = medians(results)
    first = [r["tokens_per_s"] for r in (results["course"][0][0], results["course"][1][0])]
    assert table["course"][0]["tokens_per_s"] == pytest.approx(sum(first) / 2)
    assert "course-static" in format_race(table)


def test_a_gpt2_folder_is_served_with_gpt2s_tokenizer(tmp_path):
    """GPT-2's own tokenizer (tiktoken) travels with a GPT-2-vocabulary model: the folder loads it back, a client's
    text is encoded as GPT-2 encodes it, and a greedy completion is generate_with_cache's, decoded by GPT-2."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=get_tokenizer().n_vocab, context_length=32, d_model=16, n_heads=2, n_layers=1,
                       dropout=0.0)
    served = load_for_serving(export_for_serving(GPT(config), get_tokenizer(), tmp_path / "gpt2-tiny"),
                              dtype=torch.float64)
    assert served.tokenizer is get_tokenizer() and served.eos_id == 50256
    prompt = "Hello, naïve world"
    assert served.encode(prompt) == get_tokenizer().encode(prompt)
    expected = text_of(served, reference(served, served.encode(prompt), 8))

    async def scenario():
        loop = EngineLoop(Engine(served.model, max_batch=2), max_waiting=2).start()
        try:
            transport = httpx.ASGITransport(app=create_app(served, loop))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                body = {"model": "gpt2-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
                return (await client.post("/v1/completions", json=body)).json()
        finally:
            loop.stop(30)

    answer = asyncio.run(scenario())
    assert answer["choices"][0]["text"] == expected
    assert answer["usage"]["prompt_tokens"] == len(get_tokenizer().encode(prompt))


def test_a_request_larger_than_the_cache_is_refused_with_400(served64):
    loop = EngineLoop(Engine(served64.model, max_batch=1, block_size=8, num_blocks=2), max_waiting=0)

    async def scenario():
        async with in_process_client(served64, loop) as client:
            return await client.post("/v1/completions", json={"model": "tiny", "prompt": "The", "max_tokens": 40})

    refused = asyncio.run(scenario())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "KV blocks" in refused.json()["error"]["message"] and loop.admitted == 0


@pytest.mark.parametrize("prompt, max_tokens, param, code", [
    ([5] * 65, 1, "prompt", "context_length_exceeded"),
    ([5] * 10, 60, "max_tokens", "context_length_exceeded"),
    ([5, 320], 4, "prompt", None),
    ([5] * 10, 50, "max_tokens", None),  # fits the context, not the 4 blocks of 8 tokens
], ids=["prompt past the context", "max_tokens past the context", "id outside the vocabulary", "past the cache"])
def test_a_request_the_engine_refuses_gets_its_words_and_the_field_in_a_400(served64, prompt, max_tokens, param,
                                                                            code):
    """The API asks the engine (Engine.check) and names its own field: one rule, one message, for both (a server
    adds where its cache's size is set)."""
    engine = Engine(served64.model, max_batch=1, block_size=8, num_blocks=4)
    with pytest.raises(RequestRefused) as refused_by_engine:
        engine.check(Request("x", tuple(prompt), max_tokens, served64.eos_id))

    async def scenario():
        async with in_process_client(served64, EngineLoop(engine, max_waiting=0)) as client:
            return await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                              "max_tokens": max_tokens})

    refused = asyncio.run(scenario())
    error = refused.json()["error"]
    assert refused.status_code == 400 and (error["param"], error["code"]) == (param, code)
    assert re.sub(r"^request 'cmpl-[0-9a-f]+'", "request 'x'", error["message"]).startswith(
        str(refused_by_engine.value))


def test_a_client_that_leaves_a_non_streamed_request_has_it_aborted(served64):
    """Called as uvicorn calls it, with the client gone after its body: the app returns (no hang) and the request
    leaves the engine, so its blocks and its place in the queue are free."""
    loop = EngineLoop(Engine(served64.model, max_batch=1), max_waiting=0)  # not started: it would wait forever
    app = create_app(served64, loop)
    body = json.dumps({"model": "tiny", "prompt": "The", "max_tokens": 40}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():  # as uvicorn's, once the client has gone: the disconnect at once
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    assert sent[0]["status"] == 499 and loop.admitted == 1  # the abort waits in the loop's inbox
    loop.start()
    wait_for(lambda: loop.admitted == 0, 30, "the aborted request is still admitted")
    assert loop.engine.live_requests == 0 and loop.engine.cache.allocator.num_used == 0
    loop.stop(30)


def test_an_engine_failure_reaches_every_client_as_an_error(served64, monkeypatch):
    """A failed iteration answers 500 (or an error event in a stream, then [DONE]); a loop whose thread died ends
    every request it held and refuses new ones with 503, instead of leaving clients waiting."""
    engine = Engine(served64.model, max_batch=2)
    loop = EngineLoop(engine, max_waiting=2).start()

    def failing_step(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", failing_step)

    async def scenario():
        async with in_process_client(served64, loop) as client:
            body = {"model": "tiny", "prompt": "The", "max_tokens": 4}
            whole = await client.post("/v1/completions", json=body)
            streamed = await client.post("/v1/completions", json=body | {"stream": True})
            return whole, streamed

    try:
        whole, streamed = asyncio.run(scenario())
    finally:
        monkeypatch.undo()
    assert whole.status_code == 500 and "boom" in whole.json()["error"]["message"]
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "boom" in json.loads(events[0][6:])["error"]["message"] and events[-1] == "data: [DONE]"

    monkeypatch.setattr(engine, "generated", failing_step)  # now the loop itself fails, after a step
    stuck = Collector()
    loop.submit(Request("x", (1, 2), 5), stuck)
    assert stuck.done.wait(60) and stuck.updates[-1].error and "boom" in stuck.updates[-1].error
    wait_for(lambda: not loop.alive, 30, "the failed loop's thread still runs")
    with pytest.raises(EngineStopped, match="boom"):
        loop.submit(Request("y", (1, 2), 5), Collector())


# ---- the engine in a process of its own ----


def engine_process(folder, **settings) -> EngineProcess:
    served = load_for_serving(folder, device="meta", dtype=torch.float64)
    return EngineProcess(EngineSettings(str(folder), dtype="float64", threads=1, **settings), served.model).start()


def collect(updates: list, done: threading.Event):
    def deliver(update):
        updates.append(update)
        if update.finish_reason is not None:
            done.set()
    return deliver


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_an_engine_process_gives_generate_with_caches_tokens_and_refuses_past_its_capacity(folder, served64):
    engine = engine_process(folder, max_batch=1, max_waiting=1)
    try:
        prompts = [served64.encode("The quick brown"), served64.encode("def main")]
        runs = [([], threading.Event()) for _ in prompts]
        for i, (prompt, (updates, done)) in enumerate(zip(prompts, runs, strict=True)):
            engine.submit(Request(i, tuple(prompt), 12), collect(updates, done))
        with pytest.raises(QueueFull):  # one running and one waiting: the most it holds
            engine.submit(Request(2, tuple(prompts[0]), 12), lambda update: None)
        for prompt, (updates, done) in zip(prompts, runs, strict=True):
            assert done.wait(60)
            expected = generate_with_cache(served64.model, torch.tensor([prompt]), 12)[0, len(prompt):].tolist()
            assert [t for u in updates for t in u.tokens] == expected and updates[-1].finish_reason == "length"
        wait_for(lambda: engine.stats.blocks_used == 0 and engine.stats.iterations > 0, 30, "stats not sent")
        assert engine.admitted == 0
    finally:
        engine.stop(30)
    assert not engine.alive


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_an_engine_process_that_dies_ends_every_live_request_and_refuses_new_ones(folder, served64):
    engine = engine_process(folder, max_batch=1, max_waiting=4)
    try:
        updates, done = [], threading.Event()
        engine.submit(Request("long", tuple(served64.encode("The quick")), 60), collect(updates, done))
        waiting, ended = [], threading.Event()
        engine.submit(Request("waiting", tuple(served64.encode("def")), 60), collect(waiting, ended))
        os.kill(engine.pid, signal.SIGKILL)
        assert done.wait(30) and ended.wait(30)
        assert updates[-1].finish_reason == waiting[-1].finish_reason == "error"
        assert "exited with code" in updates[-1].error
        assert not engine.alive
        with pytest.raises(EngineStopped, match="exited with code"):
            engine.submit(Request("late", (1, 2), 4), lambda update: None)
    finally:
        engine.stop(5)
