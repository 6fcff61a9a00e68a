"""bench.gpu_check, the script prepared for a lent GPU machine: its CPU run keeps every
path of it working between loans, and without CUDA it refuses to pretend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.gpu_check import main


def test_the_cpu_run_checks_parity_and_measures_each_backend_that_builds(
    default_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "gpu_check.json"
    argv = ["--model", str(default_model_dir), "--device", "cpu", "--concurrency", "2"]
    argv += ["--temperatures", "1.0", "--parity-prompts", "3", "--new-tokens", "5"]
    argv += ["--output-len", "8"]  # a short decode: what is checked is the report's shape
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    parity = report["parity"]
    # The CPU against itself: every greedy token and every logit agree exactly.
    assert parity["all_equal"] and parity["agreeing_prefix"] == [5, 5, 5]
    assert parity["last_token_logits_max_abs_diff"] == 0.0
    assert report["attention_backends"]["torch"] == "ok"
    assert report["attention_backends"]["flash_attn"].startswith("unavailable")
    (row,) = report["throughput"]
    assert row["attention_backend"] == "torch" and row["concurrency"] == 2
    # A ratio of two timings is no bound to assert (an 8-token decode of the tiny model
    # read 2.08 once): that the row is measured and its ratio is of its own two figures.
    assert row["engine_tok_s"] > 0 and row["bound_tok_s"] > 0
    assert row["ratio"] == pytest.approx(row["engine_tok_s"] / row["bound_tok_s"], rel=1e-3)
    (overlap,) = report["overlap"]
    assert overlap["concurrency"] == 2 and len(overlap["round_ratios"]) == 3
    assert overlap["sync_tok_s"] > 0 and overlap["overlap_tok_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without CUDA")
def test_without_cuda_it_says_so_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "no CUDA device" in capsys.readouterr().out
