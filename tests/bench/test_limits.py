"""bench.limits on the tiny default model, so its arithmetic cannot rot: the weight bytes
and FLOPs it divides by are the model's own, and every ratio is the quotient it claims."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench import limits
from services.scheduler.model_executor.models.config import ModelConfig
from services.scheduler.transport.engine_build import load_kernels
from tests.scheduler.conftest import kernel_model_dir, needs_compiler

__all__ = ["kernel_model_dir"]  # the fixture, imported for this module's tests


def test_a_run_reports_its_limits_and_the_ratios_to_them(
    default_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "limits.json"
    argv = ["--model", str(default_model_dir), "--dtype", "float32", "--prompt-len", "96"]
    small = ["--context", "16", "--repeats", "2", "--copy-mib", "16", "--gemm-rows", "64"]
    limits.main([*argv, *small, "--out", str(out)])
    report = json.loads(out.read_text())
    config = ModelConfig.from_dir(default_model_dir)
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    per_layer = h * (config.num_heads * config.head_dim + 2 * kv)  # q, k, v
    per_layer += config.num_heads * config.head_dim * h  # o
    per_layer += 3 * h * config.intermediate_size  # gate, up, down
    weights = config.num_layers * per_layer + h * config.vocab_size  # and the LM head
    decode, prefill, bounds = report["decode"], report["prefill"], report["limits"]
    assert report["dtype"] == "float32" and bounds["gemm_rows"] == 64
    # The forward measured is the served one: the row kernels on wherever they are built.
    kernels = load_kernels(str(default_model_dir), torch.device("cpu"))
    assert report["row_kernels"] == kernels.row_kernels
    assert decode["weight_gb"] == pytest.approx(4 * weights / 1e9)
    assert decode["forward_gb_s"] == pytest.approx(decode["weight_gb"] / decode["forward_ms"] * 1e3)
    assert decode["forward_of_copy"] == pytest.approx(decode["forward_gb_s"] / bounds["copy_gb_s"])
    attention = 4 * config.num_layers * config.num_heads * config.head_dim * (96 + 1) / 2
    flops = 2 * config.num_layers * per_layer + attention
    assert prefill["gflop_per_token"] == pytest.approx(flops / 1e9)
    assert prefill["tokens_per_s"] * prefill["seconds"] == pytest.approx(96)
    assert prefill["of_gemm"] == pytest.approx(prefill["tflops"] / bounds["gemm_tflops"])
    assert all(v > 0 for v in [*decode.values(), *prefill.values(), *bounds.values()])


@needs_compiler
def test_with_decode_copies_it_measures_decode_on_both_weights(
    kernel_model_dir: Path, tmp_path: Path
) -> None:
    if not torch.ops.tokenline.bf16_blocks():
        pytest.skip("the kernels are not built for AVX512-BF16 on this CPU")
    out = tmp_path / "limits.json"
    argv = ["--model", str(kernel_model_dir), "--dtype", "bfloat16", "--prompt-len", "96"]
    small = ["--context", "16", "--repeats", "2", "--copy-mib", "16", "--gemm-rows", "64"]
    limits.main([*argv, *small, "--decode-copy", "--out", str(out)])
    report = json.loads(out.read_text())
    decode, packed = report["decode"], report["decode_packed"]
    assert packed is not None and packed["weight_gb"] == decode["weight_gb"]
    for run in (decode, packed):
        assert run["forward_gb_s"] == pytest.approx(run["weight_gb"] / run["forward_ms"] * 1e3)
    assert report["args"]["decode_copy"] == "True"
