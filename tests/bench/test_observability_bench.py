"""bench.observability runs in a short mode and writes every field with a sane value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import observability


def test_short_run_writes_both_comparisons(default_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "observability.json"
    observability.main(
        ["--model", str(default_model_dir), "--concurrency", "2", "--output-len", "4"]
        + ["--rounds", "1", "--calls", "50", "--out", str(out)]
    )
    result = json.loads(out.read_text())
    (row,) = result["engine"]
    assert row["concurrency"] == 2
    assert row["plain_step_ms"] > 0 and row["recorded_step_ms"] > 0 and row["record_us"] > 0
    assert row["ratio"] == pytest.approx(row["recorded_step_ms"] / row["plain_step_ms"])
    rpc = result["rpc"]
    assert min(rpc["plain_us"], rpc["noop_us"], rpc["intercepted_us"]) > 0
    assert 0 < row["record_share"] < 1
    assert rpc["ratio"] == pytest.approx(rpc["intercepted_us"] / rpc["plain_us"])
