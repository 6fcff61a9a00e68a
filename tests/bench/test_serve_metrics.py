"""The metric math of bench/serve on hand-built timings."""

from __future__ import annotations

import math

import pytest

from bench.serve.client import RequestResult
from bench.serve.metrics import (
    first_errors,
    latency_samples,
    latency_stats_ms,
    percentile,
    summarize,
    tpot_s,
    usage_source,
)
from bench.serve.report import build_report, warmup_lines
from bench.serve.runner import RunOutcome, arrival_delays
from bench.serve.side_by_side import ratio_lines, ratios


def done(
    start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10
) -> RequestResult:
    """A successful request whose chunks arrived at ttft, ttft+itl[0], ..."""
    return RequestResult(
        start_s=start,
        success=True,
        ttft_s=ttft,
        e2e_s=ttft + sum(itl),
        itl_s=itl,
        prompt_tokens=prompt,
        output_tokens=tokens,
        is_usage_from_server=True,
    )


def failed(start: float, error: str) -> RequestResult:
    return RequestResult(start_s=start, error=error)


def test_percentile_interpolates_linearly_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 0.9·3 = 2.7: 3 + 0.7·1
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_latency_stats_are_milliseconds_and_none_when_empty() -> None:
    stats = latency_stats_ms([0.1, 0.2, 0.3])
    assert stats["count"] == 3
    assert stats["mean"] == pytest.approx(200.0)
    assert stats["p50"] == pytest.approx(200.0)
    assert (stats["min"], stats["max"]) == (pytest.approx(100.0), pytest.approx(300.0))
    empty = latency_stats_ms([])
    assert empty["count"] == 0 and empty["p99"] is None and empty["mean"] is None


def test_tpot_spreads_decode_time_over_tokens_after_the_first() -> None:
    # 5 tokens: first at 0.2 s, the other 4 in 0.8 s -> 0.2 s each
    assert tpot_s(done(0, 0.2, [0.2, 0.2, 0.2, 0.2], tokens=5)) == pytest.approx(0.2)
    # 2 chunks carrying 5 tokens: TPOT counts tokens, not chunks
    assert tpot_s(done(0, 0.2, [0.8], tokens=5)) == pytest.approx(0.2)
    assert tpot_s(done(0, 0.2, [], tokens=1)) is None


def test_itl_is_pooled_over_requests_per_chunk() -> None:
    results = [done(0, 0.1, [0.01, 0.03], 3), done(0, 0.2, [0.05], 2), failed(0, "x")]
    samples = latency_samples(results)
    assert samples["itl"] == [0.01, 0.03, 0.05]
    assert samples["ttft"] == [0.1, 0.2]
    assert samples["e2e"] == pytest.approx([0.14, 0.25])
    assert samples["tpot"] == pytest.approx([0.02, 0.05])


def test_summary_counts_only_successes_in_throughput() -> None:
    results = [
        done(0.0, 0.5, [0.5] * 3, tokens=4, prompt=10),
        failed(0.1, "HTTP 500: boom"),
        done(0.2, 0.5, [0.5] * 5, tokens=6, prompt=20),
        failed(0.3, "HTTP 500: boom"),
        failed(0.4, "ReadTimeout"),
    ]
    summary = summarize(RunOutcome(results, duration_s=4.0))
    assert (summary["num_requests"], summary["completed"], summary["failed"]) == (5, 2, 3)
    assert summary["errors"] == ["HTTP 500: boom", "ReadTimeout"]
    assert (summary["total_input_tokens"], summary["total_output_tokens"]) == (30, 10)
    assert summary["request_throughput"] == pytest.approx(0.5)
    assert summary["output_throughput"] == pytest.approx(2.5)
    assert summary["total_token_throughput"] == pytest.approx(10.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500.0)
    assert summary["e2e_ms"]["max"] == pytest.approx(3000.0)
    assert summary["itl_ms"]["count"] == 8
    assert summary["tpot_ms"]["mean"] == pytest.approx(500.0)


def test_first_errors_keep_send_order_distinct_and_capped() -> None:
    results = [failed(9 - i, f"e{i % 7}") for i in range(10)]
    assert first_errors(results) == ["e2", "e1", "e0", "e6", "e5"]


def test_usage_source_tells_server_from_tokenizer_counts() -> None:
    server = done(0, 0.1, [], 1)
    local = done(0, 0.1, [], 1)
    local.is_usage_from_server = False
    assert usage_source([server]) == "server"
    assert usage_source([local]) == "tokenizer"
    assert usage_source([server, local]) == "mixed"
    assert usage_source([failed(0, "x")]) == "none"


def test_arrivals_are_poisson_at_the_asked_rate() -> None:
    assert arrival_delays(4, math.inf, seed=0) == [0.0] * 4
    delays = arrival_delays(4001, 20.0, seed=3)
    assert delays[0] == 0.0 and min(delays[1:]) > 0
    assert sum(delays) / 4000 == pytest.approx(1 / 20.0, rel=0.05)
    assert delays == arrival_delays(4001, 20.0, seed=3)


def summary_of(throughput: float, ttft_ms: float | None) -> dict:
    stats = {"mean": ttft_ms, "p50": ttft_ms, "p99": ttft_ms}
    empty = {"mean": None, "p50": None, "p99": None}
    return {
        "request_throughput": throughput,
        "output_throughput": throughput * 10,
        "total_token_throughput": throughput * 20,
        "ttft_ms": stats,
        "tpot_ms": empty,
        "itl_ms": empty,
        "e2e_ms": stats,
        "completed": 1,
        "failed": 0,
        "total_output_tokens": 10,
    }


def test_compare_ratios_are_ours_over_theirs() -> None:
    r = ratios(summary_of(4.0, 50.0), summary_of(2.0, 200.0))
    assert r["request_throughput"] == pytest.approx(2.0)
    assert r["output_throughput"] == pytest.approx(2.0)
    assert r["ttft_p50_ms"] == pytest.approx(0.25)
    assert r["tpot_mean_ms"] is None  # no value on either side
    assert ratios(summary_of(1.0, 1.0), summary_of(0.0, 1.0))["request_throughput"] is None
    lines = ratio_lines(summary_of(4.0, 50.0), summary_of(2.0, 200.0))
    assert any(line.startswith("request throughput") and line.endswith("2.000") for line in lines)


def test_failed_warmup_is_reported_not_hidden() -> None:
    warmup = RunOutcome([done(0, 0.1, [], 1), failed(0.1, "ReadTimeout")], duration_s=1.0)
    run = RunOutcome([done(0, 0.1, [0.1], 2)], duration_s=1.0)
    report = build_report("x", {}, run, warmup)
    assert report["warmup"] == {"num_requests": 2, "failed": 1, "errors": ["ReadTimeout"]}
    assert warmup_lines(report) == ["warm-up: 1 of 2 failed: ReadTimeout"]
    assert warmup_lines(build_report("x", {}, run, None)) == []
