"""The frontend's Prometheus metrics: per-stage latencies, live requests, tokenizer calls.

Stage latencies come from each finished choice's StageTimes (the frontend's
stamps plus the scheduler's), so they are the same numbers a client reads in
the response's ``times``.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from tokenline.v1 import detokenizer_pb2

from services.common.stages import stage_durations
from services.frontend.serving.output import finish_name
from services.frontend.serving.response_store import ResponseStore

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.stage_seconds = Histogram(
            "tokenline_frontend_stage_seconds",
            "time spent per request stage, from the StageTimes of each finished choice",
            ["stage"],
            buckets=_SECONDS,
            registry=registry,
        )
        self.tokenizer_seconds = Histogram(
            "tokenline_frontend_tokenizer_seconds",
            "one call of the dynamic batch tokenizer (all texts in the batch)",
            buckets=_SECONDS,
            registry=registry,
        )
        self.tokenizer_batch_size = Histogram(
            "tokenline_frontend_tokenizer_batch_size",
            "texts per tokenizer call of the dynamic batch tokenizer",
            buckets=_BATCH,
            registry=registry,
        )
        self.finished = Counter(
            "tokenline_frontend_finished_choices",
            "choices that reached a final row, by finish reason",
            ["finish_reason"],
            registry=registry,
        )
        self.live_requests = Gauge(
            "tokenline_frontend_live_requests", "ReqStates in the table", registry=registry
        )
        self.aborts_sent = Gauge(
            "tokenline_frontend_aborts_sent", "AbortReq sent to schedulers", registry=registry
        )
        self.mux_streams = Counter(
            "tokenline_frontend_mux_streams",
            "Multiplex streams ended, by request kind and the status they ended with "
            "(CANCELLED: the client cancelled); per-request streams count as RPCs instead",
            ["kind", "grpc_code"],
            registry=registry,
        )
        self.stored_responses = Gauge(
            "tokenline_frontend_stored_responses",
            "/v1/responses kept for GET and previous_response_id (--response-store-size)",
            registry=registry,
        )
        self.stored_responses_dropped = Gauge(
            "tokenline_frontend_stored_responses_dropped",
            "stored responses dropped since start, for room or age (--response-store-ttl)",
            registry=registry,
        )
        # Labelled with a key's name from the key file, never its secret; nothing while
        # keys are off.
        self.key_choices = Counter(
            "tokenline_frontend_key_choices",
            "choices finished, by the name of the API key they were made with",
            ["key"],
            registry=registry,
        )
        self.key_tokens = Counter(
            "tokenline_frontend_key_tokens",
            "prompt and completion tokens of finished choices, by API key name",
            ["key", "kind"],
            registry=registry,
        )
        self.mux_batch_frames = Histogram(
            "tokenline_frontend_mux_batch_frames",
            "frames per MuxBatch sent: how many streams' messages one gRPC message carried",
            buckets=_BATCH,
            registry=registry,
        )

    def observe_finished(self, row: detokenizer_pb2.StrRow, key: str = "") -> None:
        """One choice's final row: its finish reason, its stage times and, made with the
        API key named ``key``, that key's usage."""
        self.finished.labels(finish_name(row.finish_reason)).inc()
        for stage, seconds in stage_durations(row.times).items():
            self.stage_seconds.labels(stage).observe(seconds)
        if key:
            self.key_choices.labels(key).inc()
            self.key_tokens.labels(key, "prompt").inc(row.usage.prompt_tokens)
            self.key_tokens.labels(key, "completion").inc(row.usage.completion_tokens)

    def observe_batch(self, size: int, seconds: float) -> None:
        self.tokenizer_batch_size.observe(size)
        self.tokenizer_seconds.observe(seconds)

    def track(self, live: Callable[[], int], aborts: Callable[[], int]) -> None:
        """Read gauges from their owners at scrape time."""
        self.live_requests.set_function(live)
        self.aborts_sent.set_function(aborts)

    def track_response_store(self, store: ResponseStore) -> None:
        """The response store's size and drops, read at scrape time."""
        self.stored_responses.set_function(lambda: len(store))
        self.stored_responses_dropped.set_function(lambda: store.num_evicted)
