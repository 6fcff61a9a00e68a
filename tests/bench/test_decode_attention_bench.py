"""``bench.decode_attention``: a row per request count and slot layout, and each GB/s the
pool's bytes that call read over its time (the kernel itself is tested in
tests/scheduler/model_executor/test_attention.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from bench import decode_attention
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.transport.engine_build import load_kernels


def test_every_row_reports_the_bytes_it_read_over_its_time(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not load_kernels(str(default_model_dir), torch.device("cpu")).decode_attention:
        pytest.skip("no compiled kernels on this machine (make model builds them)")
    monkeypatch.setattr(decode_attention, "REQUESTS", (1, 3))
    monkeypatch.setattr(decode_attention, "POOL_SLOTS", 4096)
    monkeypatch.setattr(decode_attention, "SWEEP_BYTES", 1 << 20)
    out = tmp_path / "decode_attention.json"
    argv = ["bench.decode_attention", "--model", str(default_model_dir), "--keys", "17"]
    monkeypatch.setattr(sys, "argv", [*argv, "--repeats", "3", "--out", str(out)])
    decode_attention.main()
    report = json.loads(out.read_text())
    config = ModelConfig.from_dir(default_model_dir)
    rows = report["rows"]
    assert [(row["requests"], row["layout"]) for row in rows] == [
        (1, "in order"),
        (1, "random"),
        (3, "in order"),
        (3, "random"),
    ]
    for row in rows:
        read = decode_attention.pool_bytes(
            row["requests"], 17, config.num_kv_heads, config.head_dim
        )
        assert read == 2 * row["requests"] * 17 * config.num_kv_heads * config.head_dim * 2
        for timing in ("warm", "from_memory"):
            assert row[f"{timing}_us"] > 0
            assert row[f"{timing}_gbps"] == pytest.approx(read / row[f"{timing}_us"] / 1e3)
