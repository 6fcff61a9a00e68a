"""The JSON report of one run and its printed summary."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.serve.client import RequestSettings
from bench.serve.datasets import DatasetConfig
from bench.serve.metrics import LATENCY_METRICS, first_errors, request_rows, summarize
from bench.serve.runner import LoadConfig, RunOutcome

RESULTS_DIR = Path("bench/results")


def config_dict(
    settings: RequestSettings,
    dataset: DatasetConfig,
    load: LoadConfig,
    num_warmup: int,
    warmup_timeout_s: float,
) -> dict[str, Any]:
    """Every setting that shaped the run (the API key left out)."""
    request = {k: v for k, v in dataclasses.asdict(settings).items() if k != "api_key"}
    load_dict = dataclasses.asdict(load)
    if math.isinf(load.request_rate):
        load_dict["request_rate"] = "inf"  # JSON has no infinity
    return {
        "request": request,
        "dataset": dataclasses.asdict(dataset),
        "load": load_dict,
        "num_warmup": num_warmup,
        "warmup_timeout_s": warmup_timeout_s,
    }


def build_report(
    name: str, config: dict[str, Any], outcome: RunOutcome, warmup: RunOutcome | None
) -> dict[str, Any]:
    warmup_results = warmup.results if warmup else []
    return {
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config,
        "summary": summarize(outcome),
        "warmup": {
            "num_requests": len(warmup_results),
            "failed": sum(not r.success for r in warmup_results),
            "errors": first_errors(warmup_results),
        },
        "requests": request_rows(outcome.results),
    }


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """A fixed-width table of one run's summary, as vLLM prints it."""
    lines = [
        f"{'requests completed / failed':<34}{summary['completed']} / {summary['failed']}",
        f"{'duration (s)':<34}{summary['duration_s']:.2f}",
        f"{'input / output tokens':<34}"
        f"{summary['total_input_tokens']} / {summary['total_output_tokens']}"
        f"  (usage: {summary['usage_source']})",
        f"{'request throughput (req/s)':<34}{summary['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<34}{summary['output_throughput']:.2f}",
        f"{'total token throughput (tok/s)':<34}{summary['total_token_throughput']:.2f}",
        f"{'latency (ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in LATENCY_METRICS:
        stats = summary[f"{name}_ms"]
        cells = "".join(_cell(stats[k]) for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<10}{cells}")
    lines += [f"error: {message}" for message in summary["errors"]]
    return lines


def _cell(value: float | None) -> str:
    return f"{'-':>10}" if value is None else f"{value:>10.2f}"


def warmup_lines(report: dict[str, Any]) -> list[str]:
    """A warning when warm-up requests failed (the measured run may then be the warm-up)."""
    warmup = report["warmup"]
    if not warmup["failed"]:
        return []
    errors = "; ".join(warmup["errors"])
    return [f"warm-up: {warmup['failed']} of {warmup['num_requests']} failed: {errors}"]
