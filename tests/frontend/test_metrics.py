"""Stage latencies reach Prometheus from a finished choice's StageTimes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from tokenline.v1 import common_pb2

from services.frontend.metrics import STAGES, FrontendMetrics


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_every_stage_is_observed_from_the_stamps() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    times = common_pb2.StageTimes(
        received=10.0,
        templated=10.001,
        tokenized=10.003,
        dispatched=10.004,
        scheduled=10.010,
        first_token=10.050,
        finished=10.450,
    )
    metrics.observe_times(times)
    for stage in STAGES:
        assert sample(registry, "tokenline_frontend_stage_seconds_count", stage=stage) == 1
    ttft = sample(registry, "tokenline_frontend_stage_seconds_sum", stage="time_to_first_token")
    assert abs(ttft - 0.050) < 1e-6
    assert sample(registry, "tokenline_frontend_finished_choices_total") == 1


def test_missing_stamps_are_skipped_not_counted_as_zero() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    metrics.observe_times(common_pb2.StageTimes(received=1.0, finished=2.0))
    assert sample(registry, "tokenline_frontend_stage_seconds_count", stage="end_to_end") == 1
    assert sample(registry, "tokenline_frontend_stage_seconds_count", stage="queue") is None


def test_gauges_read_their_owners_and_batch_sizes_are_recorded() -> None:
    registry = CollectorRegistry()
    metrics = FrontendMetrics(registry)
    live = [3]
    metrics.track(lambda: live[0], lambda: 7)
    metrics.observe_batch(64)
    assert sample(registry, "tokenline_frontend_live_requests") == 3
    live[0] = 0
    assert sample(registry, "tokenline_frontend_live_requests") == 0
    assert sample(registry, "tokenline_frontend_aborts_sent") == 7
    assert sample(registry, "tokenline_frontend_tokenizer_batch_size_sum") == 64
