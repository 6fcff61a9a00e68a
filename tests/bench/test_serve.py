"""`python -m bench.serve` in a short mode against a live tokenline stack, as a subprocess."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from bench.serve.datasets import DatasetConfig, build_dataset
from services.launch import LocalStack

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 8
OUTPUT_LEN = 8
STATS = ("min", "p50", "p90", "p99", "max")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_bench(stack: LocalStack, model_dir: Path, out: Path, *flags: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "bench.serve",
        "--base-url", stack.base_url, "--tokenizer", str(model_dir),
        "--num-prompts", str(NUM_PROMPTS), "--output-len", str(OUTPUT_LEN),
        "--max-concurrency", "4", "--timeout", "60", "--out", str(out), *flags,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TTFT" in proc.stdout
    return json.loads(out.read_text())


def assert_png(path: Path) -> None:
    """A PNG signature, then an IHDR chunk with a non-empty image."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert kind == b"IHDR" and length == 13
    assert width > 100 and height > 100


def assert_latency_stats(summary: dict[str, Any], count: dict[str, int]) -> None:
    for metric, expected_count in count.items():
        stats = summary[f"{metric}_ms"]
        assert stats["count"] == expected_count, metric
        values = [stats[k] for k in STATS]
        assert values == sorted(values), (metric, stats)
        assert values[0] > 0, metric
        assert stats["min"] <= stats["mean"] <= stats["max"], metric


def assert_sane_report(report: dict[str, Any], prompt_lens: list[int] | None) -> None:
    summary, rows = report["summary"], report["requests"]
    assert (summary["num_requests"], summary["completed"]) == (NUM_PROMPTS, NUM_PROMPTS)
    assert (summary["failed"], summary["errors"]) == (0, [])
    assert summary["usage_source"] == "server"
    assert summary["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos
    assert [r["output_tokens"] for r in rows] == [OUTPUT_LEN] * NUM_PROMPTS
    if prompt_lens is not None:
        assert [r["prompt_tokens"] for r in rows] == prompt_lens
    assert summary["total_input_tokens"] == sum(r["prompt_tokens"] for r in rows) > 0
    duration = summary["duration_s"]
    assert duration > 0
    assert summary["request_throughput"] == pytest.approx(NUM_PROMPTS / duration)
    assert summary["output_throughput"] == pytest.approx(NUM_PROMPTS * OUTPUT_LEN / duration)
    total = summary["total_input_tokens"] + summary["total_output_tokens"]
    assert summary["total_token_throughput"] == pytest.approx(total / duration)
    num_gaps = sum(r["num_chunks"] - 1 for r in rows)
    assert_latency_stats(summary, {"ttft": 8, "tpot": 8, "itl": num_gaps, "e2e": 8})
    for row in rows:
        assert row["success"] and row["error"] is None
        assert 0 < row["ttft_s"] <= row["e2e_s"] <= duration
        assert 0 <= row["start_s"] <= duration
        assert row["tpot_s"] == pytest.approx(
            (row["e2e_s"] - row["ttft_s"]) / (row["output_tokens"] - 1)
        )
        assert 1 <= row["num_chunks"] <= OUTPUT_LEN
    assert summary["ttft_ms"]["max"] <= summary["e2e_ms"]["max"]


def test_random_chat_all_at_once(
    stack: LocalStack, default_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "serve-random.json"
    report = run_bench(stack, default_model_dir, out, "--input-len", "16", "--warmup", "2")
    assert_sane_report(report, prompt_lens=None)  # chat: the template adds tokens
    assert report["warmup"] == {"num_requests": 2, "failed": 0, "errors": []}
    assert report["config"]["load"]["request_rate"] == "inf"
    assert report["config"]["request"]["ignore_eos"] is True
    assert report["config"]["warmup_timeout_s"] == 60.0
    assert "api_key" not in report["config"]["request"]
    assert_png(out.with_suffix(".png"))


def test_shared_prefix_completions_poisson(
    stack: LocalStack,
    default_model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    tmp_path: Path,
) -> None:
    out = tmp_path / "serve-shared.json"
    flags = ["--dataset", "shared-prefix", "--endpoint", "completions", "--input-len", "8"]
    flags += ["--prefix-len", "32", "--num-groups", "2", "--request-rate", "40", "--warmup", "0"]
    report = run_bench(stack, default_model_dir, out, *flags)
    config = DatasetConfig(
        "shared-prefix", NUM_PROMPTS, 8, OUTPUT_LEN, prefix_len=32, num_groups=2, seed=0
    )
    prompt_lens = [p.prompt_len for p in build_dataset(config, tokenizer)]
    assert_sane_report(report, prompt_lens)  # completions: the server counts what we sent
    assert report["config"]["load"]["request_rate"] == 40
    assert report["warmup"]["num_requests"] == 0
    starts = [r["start_s"] for r in report["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0  # Poisson arrivals, not all at once
    assert math.isfinite(report["summary"]["duration_s"])
    assert_png(out.with_suffix(".png"))
