"""The numbers a run reports, from per-request timings (vLLM `bench serve` definitions).

- TTFT: send → first chunk with generated text.
- ITL: the gap between consecutive text chunks, pooled over all requests (a chunk may
  carry several tokens, so ITL is per chunk, not per token).
- TPOT: per request, (E2E − TTFT) / (output tokens − 1); requests of one token have none.
- E2E: send → end of stream.
Throughputs divide by the run's wall time (first send → last finish); only successes count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.serve.client import RequestResult
from bench.serve.runner import RunOutcome

PERCENTILES = (50, 90, 99)
MAX_ERRORS_REPORTED = 5
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def latency_stats_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """mean, p50, p90, p99, min, max in milliseconds; None when there are no values."""
    stats: dict[str, float | int | None] = {"count": len(values_s)}
    keys = ["mean", *(f"p{q}" for q in PERCENTILES), "min", "max"]
    if not values_s:
        return stats | dict.fromkeys(keys)
    ms = [v * 1000.0 for v in values_s]
    stats["mean"] = float(np.mean(ms))
    stats |= {f"p{q}": percentile(ms, q) for q in PERCENTILES}
    return stats | {"min": min(ms), "max": max(ms)}


def tpot_s(result: RequestResult) -> float | None:
    if result.output_tokens <= 1:
        return None
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Seconds per metric over the successful requests (ITL pooled over all of them)."""
    done = [r for r in results if r.success]
    tpots = [t for t in map(tpot_s, done) if t is not None]
    return {
        "ttft": [r.ttft_s for r in done],
        "tpot": tpots,
        "itl": [gap for r in done for gap in r.itl_s],
        "e2e": [r.e2e_s for r in done],
    }


def first_errors(results: Sequence[RequestResult]) -> list[str]:
    """The first distinct error messages, in the order the requests were sent."""
    errors: list[str] = []
    for result in sorted(results, key=lambda r: r.start_s):
        if result.error and result.error not in errors:
            errors.append(result.error)
    return errors[:MAX_ERRORS_REPORTED]


def usage_source(results: Sequence[RequestResult]) -> str:
    """Where token counts came from: 'server' (stream usage), 'tokenizer', 'mixed' or 'none'."""
    sources = {r.is_usage_from_server for r in results if r.success}
    if not sources:
        return "none"
    if len(sources) == 2:
        return "mixed"
    return "server" if sources == {True} else "tokenizer"


def summarize(outcome: RunOutcome) -> dict[str, Any]:
    """The report's `summary` section."""
    done = [r for r in outcome.results if r.success]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration = outcome.duration_s
    summary: dict[str, Any] = {
        "num_requests": len(outcome.results),
        "completed": len(done),
        "failed": len(outcome.results) - len(done),
        "errors": first_errors(outcome.results),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "usage_source": usage_source(outcome.results),
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0
        else 0.0,
    }
    samples = latency_samples(outcome.results)
    summary |= {f"{name}_ms": latency_stats_ms(samples[name]) for name in LATENCY_METRICS}
    return summary


def request_rows(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-request scalars for the JSON (and the plots); ITL gaps are summarized, not listed."""
    return [
        {
            "start_s": r.start_s,
            "success": r.success,
            "ttft_s": r.ttft_s if r.success else None,
            "e2e_s": r.e2e_s if r.success else None,
            "tpot_s": tpot_s(r) if r.success else None,
            "num_chunks": len(r.itl_s) + 1 if r.success else 0,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "error": r.error or None,
        }
        for r in results
    ]
