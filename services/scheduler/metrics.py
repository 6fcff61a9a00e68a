"""The scheduler's Prometheus metrics, named in parallel with vLLM's (``vllm:`` -> ``tokenline:``).

Counters and histograms are fed from the engine's ``SchedulerStats`` after each
step; gauges read the engine thread's published snapshot at scrape time. Every
series carries ``model_name``, so replicas serving different models stay apart.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.engine_thread import EngineStats
from services.scheduler.stats import SchedulerStats

_LATENCY = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_INTER_TOKEN = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
FINISH_REASONS = ("stop", "length", "abort")


class SchedulerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        self.prompt_tokens = counter(
            "tokenline:prompt_tokens", "prompt tokens of requests that got a first token"
        ).labels(model_name)
        self.generation_tokens = counter("tokenline:generation_tokens", "tokens sampled").labels(
            model_name
        )
        self.prefix_cache_queries = counter(
            "tokenline:prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        ).labels(model_name)
        self.prefix_cache_hits = counter(
            "tokenline:prefix_cache_hits", "prompt tokens found in the prefix cache"
        ).labels(model_name)
        # vLLM's name for what the scheduler calls a retraction.
        self.retractions = counter(
            "tokenline:num_preemptions", "running requests retracted to free KV"
        ).labels(model_name)
        success = Counter(
            "tokenline:request_success",
            "requests that left the scheduler, by finish reason",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}

        self.time_to_first_token = histogram(
            "tokenline:time_to_first_token_seconds",
            "scheduler arrival to first sampled token",
            _LATENCY,
        ).labels(model_name)
        self.inter_token_latency = histogram(
            "tokenline:inter_token_latency_seconds",
            "time between consecutive tokens of one request",
            _INTER_TOKEN,
        ).labels(model_name)
        self.e2e_latency = histogram(
            "tokenline:e2e_request_latency_seconds",
            "scheduler arrival to the request leaving the scheduler",
            _LATENCY,
        ).labels(model_name)
        self.queue_time = histogram(
            "tokenline:request_queue_time_seconds",
            "time waiting before the first forward batch",
            _LATENCY,
        ).labels(model_name)
        self.prefill_time = histogram(
            "tokenline:request_prefill_time_seconds",
            "first forward batch to first token",
            _LATENCY,
        ).labels(model_name)
        self.decode_time = histogram(
            "tokenline:request_decode_time_seconds", "first token to last token", _LATENCY
        ).labels(model_name)
        self.request_prompt_tokens = histogram(
            "tokenline:request_prompt_tokens", "prompt length of finished requests", _TOKENS
        ).labels(model_name)
        self.request_generation_tokens = histogram(
            "tokenline:request_generation_tokens", "tokens generated per finished request", _TOKENS
        ).labels(model_name)
        self.iteration_tokens = histogram(
            "tokenline:iteration_tokens_total", "tokens computed per engine step", _STEP_TOKENS
        ).labels(model_name)

        self.num_running = gauge(
            "tokenline:num_requests_running", "requests in the running batch"
        ).labels(model_name)
        self.num_waiting = gauge(
            "tokenline:num_requests_waiting", "requests waiting to be scheduled"
        ).labels(model_name)
        self.kv_cache_usage = gauge(
            "tokenline:kv_cache_usage_perc",
            "fraction of the KV pool held by requests (1 = full); evictable cache counts free",
        ).labels(model_name)

    def record(self, stats: SchedulerStats) -> None:
        """Add one hand-over of engine stats."""
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.prefix_cache_queries.inc(stats.num_prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.num_prefix_cache_hits)
        self.retractions.inc(stats.num_retractions)
        for num in stats.step_tokens:
            self.iteration_tokens.observe(num)
        for seconds in stats.time_to_first_token_s:
            self.time_to_first_token.observe(seconds)
        for seconds in stats.inter_token_latency_s:
            self.inter_token_latency.observe(seconds)
        for req in stats.finished:
            self.request_success[req.finish_reason].inc()
            self.e2e_latency.observe(req.e2e_s)
            self.request_prompt_tokens.observe(req.num_prompt_tokens)
            self.request_generation_tokens.observe(req.num_generation_tokens)
            for histogram, span in (
                (self.queue_time, req.queue_s),
                (self.prefill_time, req.prefill_s),
                (self.decode_time, req.decode_s),
            ):
                if span is not None:
                    histogram.observe(span)

    def track(self, snapshot: Callable[[], EngineStats]) -> None:
        """Gauges read the engine thread's latest published snapshot when scraped."""
        self.num_running.set_function(lambda: snapshot().num_running)
        self.num_waiting.set_function(lambda: snapshot().num_waiting)
        self.kv_cache_usage.set_function(lambda: kv_usage(snapshot()))


def kv_usage(stats: EngineStats) -> float:
    """Held by live requests or shared with them; evictable cached prefixes count as free."""
    if not stats.num_total_kv_tokens:
        return 0.0
    free = stats.num_free_kv_tokens + stats.num_evictable_kv_tokens
    return 1.0 - free / stats.num_total_kv_tokens
