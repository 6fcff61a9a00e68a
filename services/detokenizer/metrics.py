"""The detokenizer's Prometheus metrics, read from the manager and servicer at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Gauge

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.server import DetokenizerServicer


def track(
    manager: DetokenizerManager,
    servicer: DetokenizerServicer,
    registry: CollectorRegistry = REGISTRY,
) -> None:
    """Register gauges whose values come from their owners when scraped."""
    stats = manager.stats
    gauges = {
        "live_states": ("live DecodeStatus entries", lambda: len(manager.states)),
        "max_states": ("--max-decode-states", lambda: manager.max_states),
        "subscribers": ("subscribed frontends", lambda: len(servicer.subscribers)),
        "dropped_rows": ("rows with no live state or subscriber", lambda: stats.num_dropped_rows),
        "refused_requests": ("new rids refused: table full", lambda: stats.num_refused_requests),
        "unstable_decodes": (
            "finals whose full decode did not extend the sent text",
            lambda: stats.num_unstable_decodes,
        ),
    }
    for name, (doc, read) in gauges.items():
        Gauge(f"tokenline_detokenizer_{name}", doc, registry=registry).set_function(read)
