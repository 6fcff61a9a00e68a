"""The scheduler's Prometheus metrics, named in parallel with vLLM's (``vllm:`` -> ``tokenline:``).

Counters and histograms are fed from the engine's ``SchedulerStats`` after each
step; gauges read the engine thread's published snapshot at scrape time. Every
series carries ``model_name``, so replicas serving different models stay apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.scheduler.core.messages import EngineStats
from services.scheduler.core.stats import SchedulerStats

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


@dataclass(frozen=True, slots=True)
class _Labelled:
    """Makes each metric with the ``model_name`` label and returns its one child."""

    model_name: str
    registry: CollectorRegistry

    def counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        metric = Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)
        return metric.labels(self.model_name)

    def gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name)


class SchedulerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry = REGISTRY) -> None:
        make = _Labelled(model_name, registry)
        self._define_counters(make)
        self._define_latencies(make)
        self._define_sizes(make)
        self._define_gauges(make)

    def _define_counters(self, make: _Labelled) -> None:
        self.prompt_tokens = make.counter(
            "tokenline:prompt_tokens", "prompt tokens of requests that got a first token"
        )
        self.generation_tokens = make.counter("tokenline:generation_tokens", "tokens sampled")
        self.prefix_cache_queries = make.counter(
            "tokenline:prefix_cache_queries", "prompt tokens looked up in the prefix cache"
        )
        self.prefix_cache_hits = make.counter(
            "tokenline:prefix_cache_hits", "prompt tokens found in the prefix cache"
        )
        # vLLM's name for what the scheduler calls a retraction.
        self.retractions = make.counter(
            "tokenline:num_preemptions", "running requests retracted to free KV"
        )
        success = Counter(
            "tokenline:request_success",
            "requests that left the scheduler, by finish reason",
            ["model_name", "finished_reason"],
            registry=make.registry,
        )
        self.request_success = {r: success.labels(make.model_name, r) for r in FINISH_REASONS}

    def _define_latencies(self, make: _Labelled) -> None:
        self.time_to_first_token = make.histogram(
            "tokenline:time_to_first_token_seconds",
            "scheduler arrival to first sampled token",
            _LATENCY,
        )
        self.inter_token_latency = make.histogram(
            "tokenline:inter_token_latency_seconds",
            "time between consecutive tokens of one request",
            _INTER_TOKEN,
        )
        self.e2e_latency = make.histogram(
            "tokenline:e2e_request_latency_seconds",
            "scheduler arrival to the request leaving the scheduler",
            _LATENCY,
        )
        self.queue_time = make.histogram(
            "tokenline:request_queue_time_seconds",
            "time waiting before the first forward batch",
            _LATENCY,
        )
        self.prefill_time = make.histogram(
            "tokenline:request_prefill_time_seconds",
            "first forward batch to first token",
            _LATENCY,
        )
        self.decode_time = make.histogram(
            "tokenline:request_decode_time_seconds", "first token to last token", _LATENCY
        )

    def _define_sizes(self, make: _Labelled) -> None:
        self.request_prompt_tokens = make.histogram(
            "tokenline:request_prompt_tokens", "prompt length of finished requests", _TOKENS
        )
        self.request_generation_tokens = make.histogram(
            "tokenline:request_generation_tokens", "tokens generated per finished request", _TOKENS
        )
        self.iteration_tokens = make.histogram(
            "tokenline:iteration_tokens_total", "tokens computed per engine step", _STEP_TOKENS
        )

    def _define_gauges(self, make: _Labelled) -> None:
        self.num_running = make.gauge(
            "tokenline:num_requests_running", "requests in the running batch"
        )
        self.num_waiting = make.gauge(
            "tokenline:num_requests_waiting", "requests waiting to be scheduled"
        )
        self.kv_cache_usage = make.gauge(
            "tokenline:kv_cache_usage_perc",
            "fraction of the KV pool held by requests (1 = full); evictable cache counts free",
        )

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
