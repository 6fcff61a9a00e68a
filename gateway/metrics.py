"""The gateway's own Prometheus metrics, in a registry owned by one app instance."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """Request counts, latency and in-flight requests, labelled by route template."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        # Per-instance registry: two apps in one process (tests) must not collide.
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenline_gateway_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tokenline_gateway_request_duration_seconds",
            "time from request start to the last byte (whole stream for SSE)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tokenline_gateway_requests_in_flight",
            "requests being served",
            registry=self.registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
