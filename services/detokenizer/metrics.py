"""The detokenizer's Prometheus metrics: decode time per scheduler step, and the
table's gauges, read from the manager and servicer at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.server import DetokenizerServicer

_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class DetokenizerMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.batch_seconds = Histogram(
            "tokenline_detokenizer_batch_seconds",
            "time to decode one scheduler step's rows (one BatchTokenIDOutput)",
            buckets=_SECONDS,
            registry=registry,
        )
        self.rows = Counter(
            "tokenline_detokenizer_rows", "token rows received from schedulers", registry=registry
        )

    def observe_batch(self, num_rows: int, seconds: float) -> None:
        self.rows.inc(num_rows)
        self.batch_seconds.observe(seconds)

    def track(self, manager: DetokenizerManager, servicer: DetokenizerServicer) -> None:
        """Register gauges whose values come from their owners when scraped."""
        stats = manager.stats
        gauges = {
            "live_states": ("live DecodeStatus entries", lambda: len(manager.states)),
            "max_states": ("--max-decode-states", lambda: manager.max_states),
            "subscribers": ("subscribed frontends", lambda: len(servicer.subscribers)),
            "dropped_rows": (
                "rows with no live state or subscriber",
                lambda: stats.num_dropped_rows,
            ),
            "refused_requests": (
                "new rids refused: table full",
                lambda: stats.num_refused_requests,
            ),
            "unstable_decodes": (
                "finals whose full decode did not extend the sent text",
                lambda: stats.num_unstable_decodes,
            ),
        }
        for name, (doc, read) in gauges.items():
            gauge = Gauge(f"tokenline_detokenizer_{name}", doc, registry=self.registry)
            gauge.set_function(read)
