"""Engine stats and the scheduler's Prometheus metrics count exactly what a known mix did."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.scheduler.core.messages import EngineStats
from services.scheduler.core.scheduler import Scheduler
from services.scheduler.core.stats import SchedulerStats
from services.scheduler.transport.metrics import SchedulerMetrics, kv_usage
from tests.scheduler.core.test_scheduler import prompt, retraction_workload
from tests.scheduler.factories import make_req, make_scheduler, run_to_completion

MODEL = "tiny"


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if got is None else got


def recorded(scheduler: Scheduler) -> tuple[CollectorRegistry, SchedulerStats]:
    """Hand the engine's stats to fresh metrics (the engine thread does this every step;
    stats add up until taken, so once at the end counts the same)."""
    registry = CollectorRegistry()
    stats = scheduler.take_stats()
    SchedulerMetrics(MODEL, registry).record(stats)
    return registry, stats


def test_a_known_mix_gives_exact_counts(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    shared = prompt(1, 24)
    # The first run tells which token greedy decoding produces second; stopping on it
    # makes a request end with "stop" at a length we can predict.
    probe = run_to_completion(
        scheduler, {0: [make_req("probe", prompt(2, 10), temperature=0.0, max_new_tokens=6)]}
    )["probe"]
    stop_at = probe.index(probe[1]) + 1
    lengths = {"a": 5, "b": 3}
    run_to_completion(
        scheduler,
        {
            0: [make_req("a", shared, max_new_tokens=5, ignore_eos=True)],
            2: [make_req("b", shared + [7, 8, 9], max_new_tokens=3, ignore_eos=True)],
            3: [
                make_req(
                    "stop",
                    prompt(2, 10),
                    temperature=0.0,
                    max_new_tokens=6,
                    stop_token_ids=[probe[1]],
                )  # fmt: skip
            ],
        },
    )
    scheduler.add_request(make_req("gone", prompt(3, 8), max_new_tokens=4))
    assert scheduler.abort("gone")
    run_to_completion(scheduler)
    registry, total = recorded(scheduler)

    generated = len(probe) + sum(lengths.values()) + stop_at
    prompts = 10 + 24 + 27 + 10  # "gone" never reached a first token
    assert value(registry, "tokenline:generation_tokens_total") == generated
    assert value(registry, "tokenline:prompt_tokens_total") == prompts
    assert value(registry, "tokenline:request_success_total", finished_reason="abort") == 1
    assert value(registry, "tokenline:request_success_total", finished_reason="stop") == 1 + (
        len(probe) < 6
    )
    assert value(registry, "tokenline:request_success_total", finished_reason="length") == 2 + (
        len(probe) == 6
    )
    # One TTFT per request with a first token; one ITL per token after the first.
    assert value(registry, "tokenline:time_to_first_token_seconds_count") == 4
    assert value(registry, "tokenline:inter_token_latency_seconds_count") == generated - 4
    assert value(registry, "tokenline:e2e_request_latency_seconds_count") == 5
    assert value(registry, "tokenline:request_queue_time_seconds_count") == 4
    assert value(registry, "tokenline:request_decode_time_seconds_count") == 4
    assert value(registry, "tokenline:request_generation_tokens_sum") == generated
    # Prefix cache: "a" found the BOS every prompt starts with, "b" all of "a"'s prompt,
    # "stop" all of "probe"'s but the last token, which is always recomputed.
    hits = 1 + 24 + 9
    assert value(registry, "tokenline:prefix_cache_queries_total") == 10 + 24 + 27 + 10
    assert value(registry, "tokenline:prefix_cache_hits_total") == hits
    assert value(registry, "tokenline:iteration_tokens_total_count") == total.num_steps > 0
    computed = value(registry, "tokenline:iteration_tokens_total_sum")
    assert computed == sum(total.step_tokens) == prompts - hits + generated - 4


def test_latencies_are_ordered_and_add_up(default_model_dir: Path) -> None:
    scheduler = make_scheduler(default_model_dir)
    run_to_completion(scheduler, {0: [make_req("r", prompt(4, 12), max_new_tokens=8)]})
    (req,) = recorded(scheduler)[1].finished
    assert req.queue_s is not None and req.prefill_s is not None and req.decode_s is not None
    assert min(req.queue_s, req.prefill_s, req.decode_s) >= 0
    assert req.queue_s + req.prefill_s + req.decode_s == pytest.approx(req.e2e_s, abs=1e-6)


def test_preemptions_are_counted(default_model_dir: Path) -> None:
    tight = make_scheduler(default_model_dir, kv_tokens=50)
    run_to_completion(tight, retraction_workload())
    registry, total = recorded(tight)
    assert total.num_retractions > 0
    assert value(registry, "tokenline:num_preemptions_total") == total.num_retractions


def test_gauges_read_the_published_snapshot() -> None:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(MODEL, registry)
    snapshot = EngineStats(
        num_waiting=3,
        num_running=2,
        num_free_kv_tokens=600,
        num_total_kv_tokens=1000,
        num_evictable_kv_tokens=150,
    )
    metrics.track(lambda: snapshot)
    assert value(registry, "tokenline:num_requests_waiting") == 3
    assert value(registry, "tokenline:num_requests_running") == 2
    assert value(registry, "tokenline:kv_cache_usage_perc") == pytest.approx(0.25)
    assert kv_usage(EngineStats()) == 0.0
