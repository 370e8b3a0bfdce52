"""The server's /metrics, in the Prometheus text format, written by `prometheus_client` into a registry of the
server's own (so two servers in one process, as in tests, never share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .engine_loop import EngineLoop
from .engine_process import EngineProcess

# Latencies on a CPU run from about a millisecond (one decode step of a small model) to tens of seconds (a
# request that waits behind a full batch).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """Requests by endpoint and status, tokens in and out, the engine's queue, KV blocks and prefix-cache hit rate
    (read from the engine's latest snapshot when scraped), and time-to-first-token and inter-token latency."""

    def __init__(self, loop: EngineLoop | EngineProcess) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("course_requests", "HTTP requests served, by endpoint and status code",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("course_prompt_tokens", "Prompt tokens of accepted requests", registry=registry)
        self.generation_tokens = Counter("course_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("course_time_to_first_token_seconds", "From a request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("course_inter_token_latency_seconds", "Between consecutive tokens of one request",
                             buckets=LATENCY_BUCKETS, registry=registry)
        for name, help_text, read in (
            ("course_running_sequences", "Sequences in the running batch", lambda: loop.stats.running),
            ("course_waiting_sequences", "Sequences waiting for the batch", lambda: loop.stats.waiting),
            ("course_kv_blocks_used", "KV-cache blocks held by sequences", lambda: loop.stats.blocks_used),
            ("course_kv_blocks_free", "KV-cache blocks free (cached prefixes included)",
             lambda: loop.stats.blocks_free),
            ("course_prefix_cache_hit_rate", "Share of the prompt tokens to prefill found in the prefix cache",
             lambda: loop.stats.prefix_hit_rate),
        ):
            Gauge(name, help_text, registry=registry).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def scrape(url: str) -> dict[str, float]:
    """Every sample of the server at `url`'s /metrics, read by Prometheus's own parser, named as the text writes
    it: `course_kv_blocks_used`, `course_requests_total{endpoint="/v1/completions",status="200"}`."""
    import httpx

    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sample.labels.items())
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples
